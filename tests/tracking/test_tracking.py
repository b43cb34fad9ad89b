import json

import pytest

from verl.errors import ConfigError, VerlError
from verl.tracking import Tracker, read_metrics
from verl.tracking.plot import plot_run, sparkline


def test_jsonl_rows_and_truncate_after_resume(tmp_path):
    tracker = Tracker(["jsonl"], tmp_path, total_steps=5)
    for step in range(1, 5):
        tracker.log({"reward/mean": step / 10, "nan_metric": float("nan")}, step)
    tracker.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[2]["reward/mean"] == pytest.approx(0.3) and rows[0]["nan_metric"] == "nan"
    resumed = Tracker(["jsonl"], tmp_path, total_steps=5, resume_step=2)
    resumed.truncate_after(2)
    resumed.log({"reward/mean": 0.9}, 3)
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    assert read_metrics(tmp_path)[-1]["reward/mean"] == 0.9


def test_unknown_backend_and_missing_extra(tmp_path):
    with pytest.raises(ConfigError, match="unknown backend"):
        Tracker(["jsonl", "tensorbord"], tmp_path)


def test_disabled_tracker_writes_nothing(tmp_path):
    tracker = Tracker(["jsonl"], tmp_path / "run", enabled=False)
    tracker.log({"a": 1.0}, 1)
    tracker.close()
    assert not (tmp_path / "run").exists()


def test_sparkline_shape():
    assert sparkline([0, 1, 2, 3]) == "▁▃▆█"
    assert len(sparkline(list(range(500)), width=40)) == 40
    assert sparkline([]) == ""


def test_plot_writes_svg_with_one_chart_per_metric(tmp_path):
    rows = [{"step": i, "reward/mean": i * 0.1, "actor/pg_loss": -i} for i in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path, charts = plot_run(tmp_path)
    assert set(charts) == {"reward/mean", "actor/pg_loss"}
    svg = path.read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 2
    with pytest.raises(VerlError, match="available keys: actor/pg_loss, reward/mean"):
        plot_run(tmp_path, keys=["val/accuracy"])
    with pytest.raises(VerlError, match="does not exist"):
        plot_run(tmp_path / "nope")


def test_the_trace_files_are_cut_back_on_resume_and_moved_aside_by_a_fresh_run(tmp_path):
    tracker = Tracker(["jsonl"], tmp_path)
    for step in (1, 2, 3):
        tracker.log_rows("rollouts.jsonl", [{"step": step, "response": "é </script>"}], "rows")
        tracker.log_rows("tokens.jsonl", [{"step": step, "tokens": ["a"], "values": {"ratio": [None]}}], "rows")
    tracker.close()
    resumed = Tracker(["jsonl"], tmp_path, resume_step=2)
    resumed.truncate_after(2)
    resumed.close()
    for name in ("rollouts.jsonl", "tokens.jsonl"):
        assert [json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()] == [1, 2]
    fresh = Tracker(["jsonl"], tmp_path, fresh=True)
    fresh.close()
    assert not (tmp_path / "rollouts.jsonl").exists() and (tmp_path / "rollouts.jsonl.1").is_file()
    assert (tmp_path / "tokens.jsonl.1").is_file()
