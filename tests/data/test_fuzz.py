"""Arbitrary bytes and arbitrary JSON never raise anything but DataError (with a line where one applies)."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl.data import load_rows
from verl.errors import DataError

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = st.sampled_from(["prompt", "sft", "preference"])
KEYS = st.sampled_from(
    [
        "input",
        "Input ",
        "output",
        "prompt",
        "question",
        "answer",
        "chosen",
        "rejected",
        "messages",
        "role",
        "content",
        "ground_truth",
        "\u200binput",
        "reward_model",
        "x",
    ]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(KEYS | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=12,
)
LINE_RE = re.compile(r"(:\d+|row \d+|lines? \d+)")


def _load(suffix: str, data: bytes, kind: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / f"f{suffix}"
        p.write_bytes(data)
        try:
            rows, report = load_rows(p, kind, on_bad_row="skip")
        except DataError as e:
            msg = str(e)
            assert msg.strip()
            if "no usable rows" not in msg and "UTF-16" not in msg and "single JSON object" not in msg:
                assert LINE_RE.search(msg), msg
            return
        assert report.total_rows == report.kept_rows + sum(s.count for s in report.reasons.values())
        assert len(rows) == report.kept_rows > 0


@SETTINGS
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".jsonl", ".json", ".csv"]), kind=KINDS)
def test_arbitrary_bytes(data: bytes, suffix: str, kind: str) -> None:
    _load(suffix, data, kind)


@SETTINGS
@given(objs=st.lists(JSON, min_size=1, max_size=5), kind=KINDS, as_list=st.booleans())
def test_arbitrary_json(objs: list, kind: str, as_list: bool) -> None:
    if as_list:
        data = json.dumps(objs, ensure_ascii=False).encode("utf-8", "surrogatepass")
        _load(".json", data, kind)
    else:
        data = b"".join(json.dumps(o).encode() + b"\n" for o in objs)
        _load(".jsonl", data, kind)


@SETTINGS
@given(
    rows=st.lists(st.dictionaries(KEYS, st.text(max_size=5) | st.none(), max_size=4), min_size=1, max_size=4),
    kind=KINDS,
)
def test_arbitrary_rows_bad_rows_name_their_line(rows: list[dict], kind: str) -> None:
    data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "f.jsonl"
        p.write_bytes(data)
        try:
            load_rows(p, kind)
        except DataError as e:
            assert re.search(r"f\.jsonl:\d+: ", str(e)), str(e)
