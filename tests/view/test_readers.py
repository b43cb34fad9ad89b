"""The incremental readers of `verl view`: only new rows per poll, partial lines waited for, bad lines skipped,
rotation and rewrites noticed; the row index's filters, sorts, search and paging; metrics and tokens."""

from __future__ import annotations

import json
import math
import os

import pytest
from view_fixtures import NEEDLE, TOKEN_VALUE, make_run, rollout

from verl.errors import ViewError
from verl.view.metrics import MetricsLog, downsample
from verl.view.rows import Query, RowIndex
from verl.view.tail import JsonlTail
from verl.view.tokens import TokenIndex


def _append(path, data: bytes) -> None:
    with path.open("ab") as fh:
        fh.write(data)


def test_tail_reads_only_what_was_appended_and_waits_for_a_complete_line(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert tail.poll().lines == []  # not written yet
    _append(path, b'{"step": 1}\n{"step": 2}\n{"step": 3, "x"')
    first = tail.poll()
    assert [ln.row["step"] for ln in first.lines] == [1, 2] and not first.reset
    assert tail.poll().lines == []  # the half-written line is not read twice, nor half
    _append(path, b': NaN}\n{"step": 4}\n')
    rows = [ln.row for ln in tail.poll().lines]
    assert rows[0]["step"] == 3 and math.isnan(rows[0]["x"]) and rows[1] == {"step": 4}
    assert tail.offset == path.stat().st_size


def test_tail_offsets_point_at_their_rows(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n')
    lines = JsonlTail(path).poll().lines
    data = path.read_bytes()
    assert [json.loads(data[ln.offset:ln.offset + ln.length]) for ln in lines] == [{"a": 1}, {"a": 2}]


def test_tail_skips_bad_lines_and_keeps_reading(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"a": 1}\nnot json\n[1, 2]\n{"b": "\xff\xfe"}\n'
                     + b'{"big": "' + b"x" * 5000 + b'"}\n{"a": 3}\n')
    tail = JsonlTail(path, max_line=1000, chunk=64)  # chunks smaller than a line, lines over the limit
    rows = [ln.row for ln in tail.poll().lines]
    assert rows[0] == {"a": 1} and rows[-1] == {"a": 3} and rows[1]["b"] == "\ufffd\ufffd"
    assert tail.bad_lines == 3 and "not a JSON object" in tail.problems[0] and "over 1000 bytes" in tail.problems[2]


def test_tail_skips_a_huge_line_written_across_polls(tmp_path):
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path, max_line=100, chunk=16)
    _append(path, b'{"a": 1}\n{"big": "' + b"x" * 300)
    assert [ln.row for ln in tail.poll().lines] == [{"a": 1}]
    _append(path, b"x" * 300)
    assert tail.poll().lines == []
    _append(path, b'"}\n{"a": 2}\n')
    assert [ln.row for ln in tail.poll().lines] == [{"a": 2}] and tail.bad_lines == 1


def test_tail_starts_over_when_the_file_is_replaced_or_shrinks(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n')
    tail = JsonlTail(path)
    assert len(tail.poll().lines) == 2
    path.replace(tmp_path / "metrics.jsonl.1")  # a fresh run rotates the old file away...
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')  # ...and writes a new one (longer, another inode)
    poll = tail.poll()
    assert poll.reset and [ln.row["step"] for ln in poll.lines] == [1, 2, 3]
    with path.open("r+b") as fh:  # a resume cuts rows past its checkpoint (same inode, shorter)
        fh.truncate(len('{"step": 1}\n'))
    poll = tail.poll()
    assert poll.reset and [ln.row["step"] for ln in poll.lines] == [1]


def test_tail_reads_a_big_file_over_several_polls(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"i": i}) + "\n" for i in range(1000)))
    tail = JsonlTail(path, chunk=256)
    seen = []
    while batch := tail.poll(max_bytes=1000).lines:
        seen += [ln.row["i"] for ln in batch]
    assert seen == list(range(1000))


# ---------------------------------------------------------------------- metrics


def test_metrics_skip_the_rotated_file_nan_and_bad_lines(tmp_path):
    run = make_run(tmp_path / "run", steps=4)
    log = MetricsLog(run)
    log.refresh()
    answer = log.since(0)
    assert [r["step"] for r in answer["rows"]] == [0, 1, 2, 3, 4]
    assert answer["rows"][2]["actor/pg_loss"] is None and answer["rows"][2]["actor/grad_norm"] is None
    assert "old_run/only_in_rotated" not in log.keys and answer["bad_lines"] == 1
    assert answer["best"] == {"step": 4, "metric": "val/accuracy", "value": 0.5, "mode": "max",
                              "source": "checkpoints/best.json"}
    _append(run / "metrics.jsonl", b'{"step": 5, "reward/mean": 1.0}\n')
    log.refresh()
    newer = log.since(answer["count"])
    assert [r["step"] for r in newer["rows"]] == [5] and newer["generation"] == answer["generation"]


def test_best_without_best_json_is_the_largest_validation_accuracy(tmp_path):
    run = make_run(tmp_path / "run", steps=6, best=False)
    log = MetricsLog(run)
    log.refresh()
    best = log.best()
    assert best["metric"] == "val/accuracy" and best["step"] == 4 and best["value"] == pytest.approx(0.5)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "best.json").write_text("{not json")  # unreadable: the fallback stays
    assert log.best()["source"] == "largest val/accuracy"


def test_downsample_keeps_the_last_and_the_validation_rows():
    rows = [{"step": i, "x": float(i)} | ({"val/accuracy": 0.1} if i % 100 == 7 else {}) for i in range(1000)]
    kept, every = downsample(rows, 100)
    assert every == 10 and kept[-1]["step"] == 999 and len(kept) <= 111
    assert {r["step"] for r in kept} >= {i for i in range(1000) if i % 100 == 7}
    assert downsample(rows[:50], 100) == (rows[:50], 1)


# ---------------------------------------------------------------------- rows


@pytest.fixture
def rollouts(tmp_path):
    index = RowIndex(make_run(tmp_path / "run", steps=6) / "rollouts.jsonl", "rollouts")
    index.refresh()
    return index


def test_row_index_by_step_and_its_summary(rollouts):
    summary = rollouts.summary()
    assert dict(summary["steps"]) == {1: 6, 2: 4, 3: 4, 4: 4, 5: 4, 6: 4}  # step 1: + the huge and the bytes rows
    assert summary["reward_names"] == ["correct", "format"] and summary["data_sources"] == ["code", "math"]
    assert summary["episodes"] == 6 and summary["bad_lines"] == 1
    assert summary["indexed_bytes"] < summary["size"]  # the last line is still being written


def test_row_index_takes_appended_rows_and_the_completed_last_line(tmp_path):
    run = make_run(tmp_path / "run", steps=2)
    path = run / "rollouts.jsonl"
    index = RowIndex(path, "rollouts")
    index.refresh()
    before = len(index)
    tail = path.read_bytes()[index.tail.offset:]
    rest = json.dumps(rollout(3, 0, 0))
    assert tail and rest.startswith(tail.decode())  # the fixture's partial line is the start of this row
    _append(path, rest[len(tail):].encode() + b"\n")
    index.refresh()
    assert len(index) == before + 1 and index.query(Query(step=3))["rows"][0]["response"] == "step 3 answer 0 to 0"


def test_row_filters_sort_and_paging(rollouts):
    page = rollouts.query(Query(step=2, sort="advantage", desc=True))
    assert [r["advantage"] for r in page["rows"]] == [0.5, 0.5, -0.5, -0.5] and page["total"] == 4
    assert all(r["data_source"] == "math" for r in rollouts.query(Query(data_source="math", limit=200))["rows"])
    high = rollouts.query(Query(rmin=0.5, limit=200))
    assert high["total"] and all(r["reward"] >= 0.5 for r in high["rows"])
    first = rollouts.query(Query(limit=10))
    second = rollouts.query(Query(offset=first["next"], limit=10))
    assert first["next"] == 10 and {r["id"] for r in first["rows"]}.isdisjoint(r["id"] for r in second["rows"])
    by_part = rollouts.query(Query(sort="r:correct", step=3))["rows"]
    assert [r["rewards"]["correct"] for r in by_part] == sorted(r["rewards"]["correct"] for r in by_part)
    by_text = rollouts.query(Query(step=1, sort="response"))["rows"]
    assert [r["response"] for r in by_text] == sorted(r["response"] for r in by_text)
    with pytest.raises(ViewError, match="no reward function of that name"):
        rollouts.query(Query(sort="r:nope"))
    with pytest.raises(ViewError, match="sort by one of"):
        rollouts.query(Query(sort="nope"))


def test_text_search_scans_lazily_and_pages_by_scan_position(rollouts, monkeypatch):
    found = rollouts.query(Query(q=NEEDLE.upper()))
    assert [r["step"] for r in found["rows"]] == [2] and found["total"] == 1 and found["next"] is None
    quoted = rollouts.query(Query(q='"CALC"', limit=200))  # a quote is escaped in the file: no byte pre-check
    assert quoted["total"] == 6 and all(r["episode"] for r in quoted["rows"])
    import verl.view.rows as rows_module

    monkeypatch.setattr(rows_module, "SCAN_LIMIT", 5)
    partial = rollouts.query(Query(q=NEEDLE))
    assert partial["rows"] == [] and partial["scanned"] == 5 and partial["total"] is None and partial["next"] == 5
    pages, offset = [], 0
    while offset is not None:
        answer = rollouts.query(Query(q=NEEDLE, offset=offset))
        pages += answer["rows"]
        offset = answer["next"]
    assert [r["response"] for r in pages] == [f"the {NEEDLE} answer"]


def test_same_prompt_episodes_and_status(rollouts):
    one = rollouts.query(Query(limit=1))["rows"][0]
    same = rollouts.query(Query(prompt_hash=one["ph"], limit=200))["rows"]
    assert len({r["step"] for r in same}) == 6 and all(r["prompt"] == one["prompt"] for r in same)
    episodes = rollouts.query(Query(episodes=True, limit=200))["rows"]
    assert len(episodes) == 6 and all(r["episode"]["turns"][1]["trained"] for r in episodes)
    bad = rollouts.query(Query(status="bad", limit=200))["rows"]
    assert {r["episode"]["status"] for r in bad} == {"timeout", "failed", "restarted"}
    with pytest.raises(ViewError, match="choose one of ok, timeout"):
        rollouts.query(Query(status="weird"))
    with pytest.raises(ViewError, match="not a prompt key"):
        rollouts.query(Query(prompt_hash="xyz"))


def test_long_text_is_clipped_and_bad_bytes_replaced(rollouts):
    rows = rollouts.query(Query(step=1, limit=200))["rows"]
    huge = next(r for r in rows if r["group"] == "g5")
    assert len(huge["response"]) < 5000 and "more characters" in huge["response"]
    assert "\ufffd" in next(r for r in rows if r["group"] == "g6")["response"]


def test_validation_samples_map_score_to_reward(tmp_path):
    index = RowIndex(make_run(tmp_path / "run") / "samples.jsonl", "samples")
    index.refresh()
    rows = index.query(Query(limit=200))["rows"]
    assert rows[0]["reward"] == 1.0 and rows[0]["extras"] == '{"parsed": 0}'
    assert next(r for r in rows if r["prompt"] == "hostile")["reward"] is None  # NaN score


def test_index_forgets_a_replaced_file(tmp_path):
    path = make_run(tmp_path / "run", steps=3) / "rollouts.jsonl"
    index = RowIndex(path, "rollouts")
    index.refresh()
    os.replace(path, tmp_path / "old.jsonl")
    path.write_text(json.dumps({"step": 9, "prompt": "p", "response": "new", "reward": 0.0}) + "\n")
    index.refresh()
    assert index.summary()["steps"] == [[9, 1]] and index.query(Query())["rows"][0]["response"] == "new"


# ---------------------------------------------------------------------- tokens


def test_tokens_by_step_and_values_made_safe(tmp_path):
    index = TokenIndex(make_run(tmp_path / "run", steps=3) / "tokens.jsonl")
    index.refresh()
    summary = index.summary()
    assert summary["steps"] == [[1, 2], [2, 2], [3, 2]]
    assert summary["names"][:3] == ["logprob", "entropy", "advantage"] and "rollout_corr_weight" in summary["names"]
    listed = index.list_step(2)
    assert [r["group"] for r in listed] == ["g0", "g1"] and listed[0]["n"] == 7
    row = index.get(listed[0]["id"])
    assert row["values"]["logprob"][3] == TOKEN_VALUE and row["values"]["logprob_gap"][3] is None  # NaN
    assert row["masked"][4] == 1 and row["clipped"][3] == 1 and len(row["values"]["ratio"]) == len(row["tokens"])
    with pytest.raises(ViewError, match="no response 99"):
        index.get(99)


def test_a_big_file_is_indexed_over_several_requests(tmp_path):
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(rollout(s, g, 0)) + "\n" for s in range(50) for g in range(4)))
    index = RowIndex(path, "rollouts", index_bytes=4000)
    index.refresh()
    first = index.summary()
    assert 0 < first["rows"] < 200 and first["indexed_bytes"] < first["size"]
    polls = 1
    while index.summary()["indexed_bytes"] < first["size"]:
        index.refresh()
        polls += 1
    assert len(index) == 200 and polls > 5 and index.query(Query(step=49))["total"] == 4


def test_polls_hand_over_one_slice_of_rows_at_a_time(tmp_path):
    """A large append is parsed a slice at a time (the rows of one slice are all a reader holds), up to the
    poll's budget; the next call goes on from there."""
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps({"step": i, "pad": "x" * 80}) + "\n" for i in range(100)), encoding="utf-8")
    tail = JsonlTail(path)
    sizes = [len(p.lines) for p in tail.polls(max_bytes=3000, slice_bytes=1000)]
    assert len(sizes) == 3 and all(0 < n <= 11 for n in sizes)  # each slice: ~1000 bytes of ~95-byte rows
    seen = sum(sizes)
    assert tail.offset == sum(len(json.dumps({"step": i, "pad": "x" * 80})) + 1 for i in range(seen))
    rest = [line.row["step"] for p in tail.polls(slice_bytes=1000) for line in p.lines]
    assert rest == list(range(seen, 100))
    assert [len(p.lines) for p in tail.polls()] == [0]  # nothing new: one empty poll, then it stops
