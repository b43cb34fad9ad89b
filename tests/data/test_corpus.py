"""The bad-file corpus: each case is a file (or directory) and the exact outcome and message it gets."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl.data import load_rows
from verl.errors import DataError


def jl(*objs: object) -> bytes:
    return b"".join(json.dumps(o).encode() + b"\n" for o in objs)


def parquet(rows: list[dict]) -> Callable[[Path], None]:
    def write(p: Path) -> None:
        pq.write_table(pa.Table.from_pylist(rows), str(p))

    return write


@dataclass
class Case:
    name: str
    files: dict[str, bytes | Callable[[Path], None]]
    kind: str = "sft"
    target: str | None = None  # file or directory to load; default: the only file
    fields: dict[str, str] | None = None
    kept: int | None = None
    reasons: dict[str, list[int]] = field(default_factory=dict)  # reason key -> example lines
    detail: str | None = None  # substring of the first example's detail
    error: str | None = None  # substring of the DataError message (no rows returned)
    mapping: dict[str, str] | None = None  # field -> source key expected in the report
    notes: str | None = None


OK = {"input": "hello", "output": "world"}

CASES = [
    Case(
        "malformed_json",
        {"a.jsonl": jl(OK) + b'{"input": "x", "output": }\n' + jl(OK)},
        kept=2,
        reasons={"malformed_json": [2]},
        detail="Expecting value at column",
    ),
    Case("truncated_json", {"a.jsonl": b'{"input": "x", "output": "y"\n'}, error="no usable rows"),
    Case(
        "utf8_bom",
        {"a.jsonl": b"\xef\xbb\xbf" + jl({"Input": "a", "output": "b"})},
        kept=1,
        mapping={"input": "Input"},
    ),
    Case("crlf", {"a.jsonl": jl(OK).replace(b"\n", b"\r\n") * 3}, kept=3),
    Case(
        "trailing_space_key",
        {"a.jsonl": jl({"input ": "a", "output": "b"})},
        kept=1,
        mapping={"input": "input "},
    ),
    Case(
        "mixed_case_keys",
        {"a.jsonl": jl({"INPUT": "a", "Output": "b"})},
        kept=1,
        mapping={"input": "INPUT", "output": "Output"},
    ),
    Case("zero_width_key", {"a.jsonl": jl({"\u200binput\u200d": "a", "\ufeffoutput": "b"})}, kept=1),
    Case(
        "null_value",
        {"a.jsonl": jl(OK, {"input": "a", "output": None})},
        kept=1,
        reasons={"null: output": [2]},
        detail="'output' is null",
    ),
    Case(
        "int_value",
        {"a.jsonl": jl({"input": "a", "output": 5}, OK)},
        kept=1,
        reasons={"wrong_type: output": [1]},
        detail="'output' is int 5; expected a string",
    ),
    Case("bool_value", {"a.jsonl": jl({"input": True, "output": "b"})}, error="wrong_type: input"),
    Case(
        "list_of_ints",
        {"a.jsonl": jl({"input": [1, 2], "output": "b"}, OK)},
        kept=1,
        reasons={"bad_messages: input": [1]},
        detail="input[0] is int 1",
    ),
    Case(
        "dict_value",
        {"a.jsonl": jl({"input": {"x": 1}, "output": "b"}, OK)},
        kept=1,
        reasons={"wrong_type: input": [1]},
        detail="expected a string or chat messages",
    ),
    Case(
        "empty_string",
        {"a.jsonl": jl(OK, OK, {"input": "", "output": "b"})},
        kept=2,
        reasons={"empty: input": [3]},
        detail="'input' is empty",
    ),
    Case(
        "whitespace_only",
        {"a.jsonl": jl({"input": "a", "output": " \t\n"}, OK)},
        kept=1,
        reasons={"empty: output": [1]},
        detail="whitespace only",
    ),
    Case(
        "duplicate_aliases",
        {"a.jsonl": jl({"question": "a", "prompt": "b", "output": "c"}, OK)},
        kept=1,
        reasons={"duplicate_field: input": [1]},
        detail="keys 'question' and 'prompt' both mean 'input'",
    ),
    Case(
        "duplicate_aliases_mapped",
        {"a.jsonl": jl({"question": "a", "prompt": "b", "output": "c"})},
        fields={"input": "question"},
        kept=1,
        mapping={"input": "question"},
    ),
    Case(
        "same_key_case_variants",
        {"a.jsonl": jl({"Input": "a", "input ": "b", "output": "c"}, OK)},
        kept=1,
        reasons={"duplicate_field: input": [1]},
    ),
    Case(
        "exact_duplicate_key",
        {"a.jsonl": b'{"input": "a", "input": "b", "output": "c"}\n' + jl(OK)},
        kept=1,
        reasons={"duplicate_key": [1]},
        detail="'input' appears twice",
    ),
    Case(
        "missing_field",
        {"a.jsonl": jl(OK, {"input": "a"}, {"input": "a", "reply": "b"})},
        kept=1,
        reasons={"missing: output": [2, 3]},
        detail="no key for 'output'",
    ),
    Case(
        "missing_mapped_key",
        {"a.jsonl": jl({"q": "a", "output": "b"})},
        fields={"input": "question"},
        error="data.fields.input='question' but the row has no key 'question'",
    ),
    Case(
        "aliases_question_answer",
        {"a.jsonl": jl({"question": "a", "answer": "b"})},
        kept=1,
        mapping={"input": "question", "output": "answer"},
    ),
    Case(
        "nested_path_mapped",
        {"a.jsonl": jl({"q": "hi", "reward_model": {"ground_truth": "5", "style": "rule"}})},
        kind="prompt",
        fields={"prompt": "q", "ground_truth": "reward_model.ground_truth"},
        kept=1,
        mapping={"prompt": "q", "ground_truth": "reward_model.ground_truth"},
    ),
    Case(
        "nested_path_verl_default",
        {
            "a.jsonl": jl(
                {
                    "prompt": [{"role": "user", "content": "hi"}],
                    "data_source": "gsm8k",
                    "reward_model": {"ground_truth": "5"},
                }
            )
        },
        kind="prompt",
        kept=1,
        mapping={"ground_truth": "reward_model.ground_truth", "data_source": "data_source"},
    ),
    Case(
        "nested_path_missing",
        {"a.jsonl": jl({"prompt": "hi", "reward_model": {"style": "rule"}}, {"prompt": "x"})},
        kind="prompt",
        fields={"ground_truth": "reward_model.ground_truth"},
        kept=2,
    ),
    Case("empty_file", {"a.jsonl": b""}, error="no usable rows"),
    Case("blank_lines_only", {"a.jsonl": b"\n\r\n   \n"}, error="no rows at all"),
    Case(
        "non_utf8_line",
        {"a.jsonl": jl(OK) + b'{"input": "caf\xe9", "output": "b"}\n' + jl(OK)},
        kept=2,
        reasons={"not_utf8": [2]},
        detail="(0xe9) is not UTF-8",
    ),
    Case(
        "non_utf8_json_file",
        {"a.json": b'[\n{"input": "a", "output": "b"},\n{"input": "\xff"}]'},
        error="a.json:3: byte 0xff is not valid UTF-8",
    ),
    Case("utf16_file", {"a.jsonl": "\ufeff{}".encode("utf-16")}, error="UTF-16"),
    Case(
        "long_line_10mb",
        {"a.jsonl": jl({"input": "hello " * (10 * 1024 * 1024 // 6), "output": "b"}, OK)},
        kept=2,
    ),
    Case(
        "huge_integer",
        {"a.jsonl": b'{"input": ' + b"1" * 5000 + b"}\n" + jl(OK)},
        kept=1,
        reasons={"malformed_json": [1]},
        detail="Exceeds the limit (4300 digits)",
    ),
    Case(
        "deep_nesting",
        {"a.jsonl": b"[" * 100000 + b"\n" + jl(OK)},
        kept=1,
        reasons={"malformed_json": [1]},
        detail="nested too deeply",
    ),
    Case(
        "json_huge_integer", {"a.json": b"[\n" + b"1" * 5000 + b"]"}, error="a.json:2: invalid JSON: Exceeds"
    ),
    Case(
        "not_an_object",
        {"a.jsonl": jl(OK, [1, 2], "text", 3)},
        kept=1,
        reasons={"not_an_object": [2, 3, 4]},
        detail="JSON list, not an object",
    ),
    Case(
        "json_list_lines",
        {"a.json": b'[\n  {"input": "a", "output": "b"},\n\n  {"input": "a"},\n  7\n]\n'},
        kept=1,
        reasons={"missing: output": [4], "not_an_object": [5]},
    ),
    Case("json_single_object", {"a.json": b'{"input": "a", "output": "b"}'}, error="a single JSON object"),
    Case(
        "json_broken_array",
        {"a.json": b'[{"input": "a", "output": "b"},\n{"input": "a" "output": "b"}]'},
        error="a.json:2: invalid JSON: Expecting ',' delimiter",
    ),
    Case(
        "json_missing_comma",
        {"a.json": b'[{"input": "a", "output": "b"}\n{"input": "a"}]'},
        error="a.json:2: invalid JSON: expected ',' or ']'",
    ),
    Case("json_is_jsonl", {"a.json": jl(OK, OK)}, kept=2, notes="read as JSON Lines"),
    Case("json_duplicate_key", {"a.json": b'[{"input": "a", "input": "b"}]'}, error="'input' appears twice"),
    Case(
        "lone_surrogate",
        {"a.jsonl": b'{"input": "a\\ud800", "output": "b"}\n' + jl(OK)},
        kept=1,
        reasons={"invalid_unicode: input": [1]},
    ),
    Case(
        "csv_bom_crlf_multiline",
        {"a.csv": b'\xef\xbb\xbfInput,output\r\nhello,world\r\n"multi\r\nline",x\r\n,empty\r\n'},
        kept=2,
        reasons={"empty: input": [5]},
    ),
    Case(
        "csv_wrong_columns",
        {"a.csv": b"input,output\na,b\nc,d,e\nf\n"},
        kept=1,
        reasons={"csv_columns": [3, 4]},
        detail="the row has 3 cells but the header has 2",
    ),
    Case("csv_non_utf8", {"a.csv": b"input,output\na,b\nc\xe9,d\n"}, kept=1, reasons={"not_utf8": [3]}),
    Case("csv_duplicate_header", {"a.csv": b"input,input,output\na,b,c\n"}, error="column 'input' twice"),
    Case("csv_header_only", {"a.csv": b"input,output\n"}, error="no usable rows"),
    Case(
        "parquet_null",
        {"a.parquet": parquet([{"input": "a", "output": "b"}, {"input": None, "output": "b"}])},
        kept=1,
        reasons={"null: input": [2]},
    ),
    Case("parquet_corrupt", {"a.parquet": b"PAR1 this is not parquet"}, error="not a readable Parquet file"),
    Case("unsupported_extension", {"a.txt": b"input,output\n"}, error="unsupported file type '.txt'"),
    Case(
        "directory_mixed",
        {
            "d/1.jsonl": jl(OK),
            "d/2.json": b"[" + json.dumps(OK).encode() + b"]",
            "d/3.csv": b"input,output\na,b\n",
            "d/4.parquet": parquet([OK, {"input": "", "output": "b"}]),
            "d/README.md": b"# notes",
            "d/.hidden.jsonl": b"garbage",
        },
        target="d",
        kept=4,
        reasons={"empty: input": [2]},
    ),
    Case("empty_directory", {"d/notes.txt": b"x"}, target="d", error="holds no data files"),
    Case(
        "prompt_messages",
        {
            "a.jsonl": jl(
                {"prompt": [{"role": "User", "content": "hi"}], "answer": 42},
                {"prompt": [{"role": "user"}]},
                {"prompt": []},
            )
        },
        kind="prompt",
        kept=1,
        reasons={"bad_messages: prompt": [2, 3]},
    ),
    Case(
        "sft_messages_no_assistant",
        {
            "a.jsonl": jl(
                {"messages": [{"role": "user", "content": "hi"}]},
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            )
        },
        kept=1,
        reasons={"no_assistant_turn: messages": [1]},
    ),
    Case(
        "prompt_duplicate_ground_truth",
        {"a.jsonl": jl({"prompt": "a", "answer": "1", "solution": "2"})},
        kind="prompt",
        error="duplicate_field: ground_truth",
    ),
    Case(
        "preference_aliases",
        {
            "a.jsonl": jl(
                {"question": "q", "preferred": "a", "dispreferred": "b"},
                {"prompt": "q", "accepted": "a", "rejected": "b"},
                {"prompt": "q", "chosen": "a"},
            )
        },
        kind="preference",
        kept=2,
        reasons={"missing: rejected": [3]},
    ),
]


def _materialise(tmp_path: Path, case: Case) -> Path:
    for name, content in case.files.items():
        p = tmp_path / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(p)
        else:
            p.write_bytes(content)
    return tmp_path / (case.target or next(iter(case.files)))


def test_corpus_is_big_enough() -> None:
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_case(tmp_path: Path, case: Case) -> None:
    target = _materialise(tmp_path, case)
    if case.error is not None:
        with pytest.raises(DataError) as ei:
            load_rows(target, case.kind, fields=case.fields, on_bad_row="skip")
        assert case.error in str(ei.value)
        return
    rows, report = load_rows(target, case.kind, fields=case.fields, on_bad_row="skip")
    assert len(rows) == report.kept_rows == case.kept
    # nothing vanishes: every row read is kept or counted under a reason
    assert report.total_rows == report.kept_rows + sum(s.count for s in report.reasons.values())
    assert {k: [e["line"] for e in s.examples] for k, s in report.reasons.items()} == case.reasons
    if case.detail is not None:
        first = next(iter(report.reasons.values())).examples[0]["detail"]
        assert case.detail in first
    for fld, src in (case.mapping or {}).items():
        assert src in report.field_mapping[fld], report.field_mapping
    if case.notes is not None:
        assert any(case.notes in n for n in report.notes)
    if case.reasons:  # with the default policy the same file fails before training, naming the lines
        with pytest.raises(DataError) as ei:
            load_rows(target, case.kind, fields=case.fields)
        msg = str(ei.value)
        key, lines = next(iter(case.reasons.items()))
        assert f"{key}: {len(lines)} rows (lines {', '.join(map(str, lines))})" in msg
        assert "data.on_bad_row=skip" in msg


def test_directory_order_and_ignored(tmp_path: Path) -> None:
    case = next(c for c in CASES if c.name == "directory_mixed")
    target = _materialise(tmp_path, case)
    rows, report = load_rows(target, "sft", on_bad_row="skip")
    assert [Path(r["file"]).name for r in rows] == ["1.jsonl", "2.json", "3.csv", "4.parquet"]
    assert [Path(p).name for p in report.ignored_files] == ["README.md"]
    assert "ignored files" in report.render()


def test_prompt_row_shape_and_metadata(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl"
    p.write_bytes(
        jl(
            {
                "Question": "hi",
                "answer": 42,
                "data_source": "gsm8k",
                " split ": "train",
                "extra_info": {"idx": 3},
            }
        )
    )
    rows, _ = load_rows(p, "prompt")
    assert rows == [
        {
            "prompt": "hi",
            "ground_truth": "42",
            "data_source": "gsm8k",
            "metadata": {"split": "train", "extra_info": {"idx": 3}},
            "line": 1,
            "file": str(p),
        }
    ]


def test_nested_path_keeps_container_in_metadata(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl"
    p.write_bytes(jl({"prompt": "hi", "reward_model": {"ground_truth": "5", "style": "rule"}}))
    rows, report = load_rows(p, "prompt")
    assert rows[0]["ground_truth"] == "5"
    assert rows[0]["metadata"] == {"reward_model": {"ground_truth": "5", "style": "rule"}}


def test_examples_capped_at_20_but_counted(tmp_path: Path) -> None:
    p = tmp_path / "a.jsonl"
    p.write_bytes(jl(*([{"input": "a"}] * 25), OK))
    rows, report = load_rows(p, "sft", on_bad_row="skip")
    st = report.reasons["missing: output"]
    assert st.count == 25 and [e["line"] for e in st.examples] == list(range(1, 21))
    assert (
        "(lines 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, ...)"
        in report.render()
    )


def test_unknown_field_in_mapping_is_config_error(tmp_path: Path) -> None:
    from verl.errors import ConfigError

    p = tmp_path / "a.jsonl"
    p.write_bytes(jl(OK))
    with pytest.raises(ConfigError, match=r"data.fields.inptu: 'inptu' is not a field of kind 'sft'"):
        load_rows(p, "sft", fields={"inptu": "question"})
    with pytest.raises(ConfigError, match="data.on_bad_row='drop'"):
        load_rows(p, "sft", on_bad_row="drop")
    with pytest.raises(ConfigError, match="data.kind='rl'"):
        load_rows(p, "rl")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist; check the path in data.train_files"):
        load_rows(tmp_path / "nope.jsonl", "sft")
