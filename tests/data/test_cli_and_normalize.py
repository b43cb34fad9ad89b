"""`verl data check|normalize`: exit codes, JSON report, canonical output, never overwriting the input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from verl.cli.data_cmd import main
from verl.data import load_rows, normalize_files
from verl.data.report import TokenStats
from verl.errors import DataError


def write(p: Path, *objs: object) -> Path:
    p.write_text("".join(json.dumps(o, ensure_ascii=False) + "\n" for o in objs), encoding="utf-8")
    return p


def test_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path / "good.jsonl", {"question": "a", "answer": "b"})
    assert main(["data", "check", str(good), "--kind", "sft"]) == 0
    out = capsys.readouterr().out
    assert "1 rows read, 1 kept, 0 dropped" in out and "'question'" in out
    bad = write(tmp_path / "bad.jsonl", {"question": "a", "answer": "b"}, {"question": "a"})
    assert main(["data", "check", str(bad), "--kind", "sft"]) == 1
    out = capsys.readouterr().out
    assert "missing: output: 1 rows" in out and "fix: add 'output'" in out and "status: not clean" in out
    assert main(["data", "check", str(tmp_path / "none.jsonl"), "--kind", "sft"]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "u16.jsonl").write_bytes("{}".encode("utf-16"))
    assert main(["data", "check", str(tmp_path / "u16.jsonl"), "--kind", "sft"]) == 2
    assert main(["data", "check", str(good), "--kind", "sft", "--map", "nonsense"]) == 2
    assert "--map 'nonsense': write FIELD=SOURCE_KEY" in capsys.readouterr().err
    (tmp_path / "empty.jsonl").write_bytes(b"")
    assert main(["data", "check", str(tmp_path / "empty.jsonl"), "--kind", "sft"]) == 1


def test_check_json_and_map(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path / "a.jsonl", {"q": "a", "prompt": "x", "answer": "b"})
    assert main(["data", "check", str(f), "--kind", "sft", "--map", "input=q", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["clean"] and rep["field_mapping"] == {"input": {"q": 1}, "output": {"answer": 1}}


def test_check_with_tokenizer(tmp_path: Path, tokenizer_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path / "a.jsonl", {"prompt": "a b c"}, {"prompt": [{"role": "user", "content": "hi"}]})
    rc = main(
        [
            "data",
            "check",
            str(f),
            "--kind",
            "prompt",
            "--tokenizer",
            tokenizer_dir,
            "--max-prompt-length",
            "4",
            "--json",
        ]
    )
    rep = json.loads(capsys.readouterr().out)
    assert rc == 1 and rep["reasons"]["too_long"]["examples"][0]["line"] == 2
    assert rep["token_stats"]["max"] == 6 and rep["token_stats"]["over_limit"] == 1
    assert main(["data", "check", str(f), "--kind", "prompt", "--tokenizer", str(tmp_path / "no")]) == 2
    assert "cannot load a tokenizer" in capsys.readouterr().err


def test_normalize_writes_canonical_jsonl(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = write(tmp_path / "raw.jsonl", {"Question ": "héllo", "answer": "wörld"}, {"question": ""})
    out = tmp_path / "out" / "clean.jsonl"
    assert main(["data", "normalize", str(src), str(out), "--kind", "sft"]) == 1
    assert out.read_text(encoding="utf-8") == '{"input": "héllo", "output": "wörld"}\n'
    rep = json.loads((tmp_path / "out" / "clean.jsonl.report.json").read_text())
    assert rep["reasons"]["empty: input"]["count"] == 1 and rep["output"] == str(out)
    assert main(["data", "normalize", str(src), str(src), "--kind", "sft"]) == 2
    assert "never overwrites its input" in capsys.readouterr().err
    assert src.read_text(encoding="utf-8").count("\n") == 2


def test_normalize_error_policy_writes_nothing(tmp_path: Path) -> None:
    src = write(tmp_path / "raw.jsonl", {"input": "a", "output": "b"}, {"input": "a"})
    out = tmp_path / "clean.jsonl"
    rep = normalize_files(src, out, "sft", on_bad_row="error")
    assert not out.exists() and rep.dropped_rows == 1
    assert not list(tmp_path.glob(".clean.jsonl.*"))  # no temp file left behind


def test_normalize_is_idempotent_for_prompt_kind(tmp_path: Path) -> None:
    src = write(
        tmp_path / "raw.jsonl",
        {"question": "2+3?", "solution": 5, "data_source": "math", "answer": "five", "meta": {"i": 1}},
    )
    with pytest.raises(DataError, match="keys 'solution' and 'answer' both mean 'ground_truth'"):
        load_rows(src, "prompt")
    once = tmp_path / "once.jsonl"
    twice = tmp_path / "twice.jsonl"
    normalize_files(src, once, "prompt", fields={"ground_truth": "solution"})
    normalize_files(once, twice, "prompt")
    assert once.read_text() == twice.read_text()
    assert json.loads(once.read_text()) == {
        "prompt": "2+3?",
        "ground_truth": "5",
        "data_source": "math",
        "metadata": {"answer": "five", "meta": {"i": 1}},
    }


def test_token_stats_against_float64_reference() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 20, 101):
        lengths = rng.integers(1, 500, size=n).tolist()
        ts = TokenStats.from_lengths(lengths, limit=250, truncation="drop", truncated=0, dropped=0)
        a = np.asarray(lengths, dtype=np.float64)
        assert ts.min == a.min() and ts.max == a.max()
        assert ts.median == np.median(a)
        assert ts.p95 == np.percentile(a, 95, method="inverted_cdf")  # nearest rank
        assert ts.over_limit == int((a > 250).sum())
    assert TokenStats.from_lengths([], None, "error", 0, 0) is None


def test_cli_prints_the_same_report_text_as_the_trainer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One renderer: `verl data check` shows DataReport.render(), the text DataError and `verl check` use."""
    f = write(tmp_path / "mixed.jsonl", {"input": "a", "output": "b"}, {"input": "c"}, {"input": "", "output": "d"})
    _rows, report = load_rows([str(f)], "sft", on_bad_row="skip")
    assert main(["data", "check", str(f), "--kind", "sft"]) == 1
    out = capsys.readouterr().out
    assert out == report.render() + "\nstatus: not clean\n"
    assert "missing: output: 1 rows" in out and "empty: input: 1 rows" in out
