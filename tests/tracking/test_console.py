"""The console (piped and terminal shapes), validation samples, metrics rotation, optional backends, PNG plots."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl.errors import ConfigError, VerlError
from verl.tracking import Tracker, read_metrics
from verl.tracking.console import ConsoleReporter, format_duration, format_points, step_line
from verl.tracking.plot import plot_run, write_png

ROOT = Path(__file__).resolve().parents[2]
METRICS = {"reward/mean": 0.25, "reward/accuracy": 0.25, "actor/pg_loss": -0.0135, "actor/entropy": 0.9977,
           "actor/clipfrac": 0.0, "actor/grad_norm": 1.491, "response/length_mean": 2.312, "timing/step": 0.36,
           "perf/tokens_per_s": 1033.0, "actor/lr": 1e-3}
SAMPLES = [{"prompt": f"{i}+1=", "response": str(i + 1) if i % 2 else "[bold]x[/bold]", "score": float(i % 2),
            "ground_truth": str(i + 1)} for i in range(8)]


def test_eta_past_a_day_shows_days():
    assert format_duration(59) == "0:00:59"
    assert format_duration(86399) == "23:59:59"
    assert format_duration(86400 + 3600 + 61) == "1d 01:01:01"
    assert format_duration(3 * 86400 + 5) == "3d 00:00:05"
    assert format_duration(float("inf")) == "?"


def test_gain_is_in_points():
    assert format_points(0.25) == "+25.0 pts"
    assert format_points(0.328 - 0.797) == "-46.9 pts"


def test_piped_step_line_is_one_unwrapped_line_with_full_names():
    out = io.StringIO()
    console = ConsoleReporter(30, file=out, tty=False)
    console.log(1, METRICS)
    text = out.getvalue()
    assert text.count("\n") == 1 and len(text) > 120  # longer than a terminal, still one line
    assert text.startswith("step 1/30  eta ")
    for field in ("reward/mean=0.25", "actor/pg_loss=-0.0135", "timing/step=0.36s", "perf/tokens_per_s=1033"):
        assert field in text  # full names: seconds are `timing/step`, never a bare `step=`
    assert "\x1b[" not in text  # no colour codes in a log file


def test_terminal_step_line_fits_the_width_keeping_the_first_fields():
    line = step_line(3, 30, "0:00:12", METRICS, width=80)
    assert len(line) <= 80 and line.startswith("step 3/30  eta 0:00:12  reward/mean=0.25")
    assert "timing/step" not in line  # the tail is left out, not wrapped
    assert len(step_line(3, 30, "0:00:12", METRICS, width=40)) <= 40


def test_samples_are_written_printed_as_plain_text_and_truncated_on_resume(tmp_path):
    out = io.StringIO()
    tracker = Tracker(["console", "jsonl"], tmp_path, total_steps=4, console_file=out)
    tracker.log({"val/score": 0.5}, 2)
    path = tracker.log_samples(SAMPLES, 2)
    tracker.log_samples(SAMPLES[:2], 4)
    tracker.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 10 and rows[0] == {"step": 2, "prompt": "0+1=", "response": "[bold]x[/bold]", "score": 0.0,
                                           "ground_truth": "1", "data_source": None}
    printed = out.getvalue().splitlines()
    assert f"validation samples at step 2 (3 of 8; all 8 in {path}):" in printed
    assert '  prompt="0+1="  response="[bold]x[/bold]"  score=0  ground_truth="1"' in printed  # not markup
    assert sum(line.startswith("  prompt=") for line in printed) == 3 + 2
    resumed = Tracker(["jsonl"], tmp_path, total_steps=4, resume_step=2)
    resumed.truncate_after(2)
    resumed.close()
    assert {r["step"] for r in read_metrics(path)} == {2}


def test_fresh_run_rotates_old_metrics_and_samples(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (tmp_path / "samples.jsonl").write_text('{"step": 1}\n')
    tracker = Tracker(["jsonl"], tmp_path, fresh=True)
    tracker.log({"loss": 2.0}, 1)
    tracker.close()
    assert [(a.name, b.name) for a, b in tracker.rotated] == [("metrics.jsonl", "metrics.jsonl.1"),
                                                              ("samples.jsonl", "samples.jsonl.1")]
    assert read_metrics(tmp_path / "metrics.jsonl.1") == [{"step": 1, "loss": 1.0}]
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]
    again = Tracker(["jsonl"], tmp_path, fresh=True)  # the next fresh run takes the next free number
    again.close()
    assert read_metrics(tmp_path / "metrics.jsonl.2") == [{"step": 1, "loss": 2.0}]
    assert read_metrics(tmp_path) == []
    kept = Tracker(["jsonl"], tmp_path / "other", fresh=False)  # a resume appends, never rotates
    kept.close()
    assert kept.rotated == []


@pytest.mark.parametrize("backend,module", [("mlflow", "mlflow"), ("wandb", "wandb"),
                                            ("tensorboard", "torch.utils.tensorboard")])
def test_missing_backend_names_the_pip_package(tmp_path, backend, module):
    try:
        __import__(module)
        pytest.skip(f"{module} is installed here")
    except ImportError:
        pass
    with pytest.raises(ConfigError) as info:
        Tracker(["jsonl", backend], tmp_path / "run")
    message = str(info.value)
    assert f"pip install {backend}" in message and f"pip install -e '.[{backend}]'" in message
    assert "verl[" not in message.replace("'.[", "")
    assert not (tmp_path / "run").exists()  # fails before writing anything


def test_import_verl_imports_no_optional_backend():
    code = ("import sys, verl, verl.tracking, verl.tracking.plot, verl.trainer.compose.loop; "
            "print([m for m in ('wandb', 'mlflow', 'tensorboard', 'matplotlib') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


def test_mlflow_backend_logs_metrics_and_samples_to_a_file_store_in_the_run_dir(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    tracker = Tracker(["mlflow"], tmp_path, config={"actor": {"lr": 0.001}}, project="verl-test", experiment="e1")
    tracker.log({"reward/mean": 0.5, "nan_metric": float("nan")}, 1)
    tracker.log({"reward/mean": 0.75}, 2)
    tracker.log_samples(SAMPLES[:2], 2)
    tracker.close()
    assert (tmp_path / "mlruns").is_dir()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name("verl-test")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "e1" and run.info.status == "FINISHED"
    assert run.data.params["actor.lr"] == "0.001"
    assert ([(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward/mean")]
            == [(1, 0.5), (2, 0.75)])
    local = client.download_artifacts(run.info.run_id, "samples/step_0000002.jsonl", str(tmp_path / "dl"))
    assert [json.loads(line)["prompt"] for line in Path(local).read_text().splitlines()] == ["0+1=", "1+1="]


def test_tensorboard_backend_logs_samples_as_text(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(["tensorboard"], tmp_path)
    tracker.log({"reward/mean": 0.5}, 1)
    tracker.log_samples(SAMPLES[:2], 1)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert "val/samples/text_summary" in events.Tags()["tensors"]


def test_wandb_backend_logs_samples_as_a_table_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # writes under the run dir, reaches no server
    tracker = Tracker(["wandb"], tmp_path, config={"actor": {"lr": 0.001}}, project="verl-test", experiment="e1")
    tracker.log({"reward/mean": 0.5, "nan_metric": float("nan")}, 1)
    tracker.log_samples(SAMPLES[:2], 2)
    tracker.close()
    (table,) = (tmp_path / "wandb").glob("offline-run-*/files/media/table/val/samples_*.table.json")
    logged = json.loads(table.read_text())
    assert logged["columns"][:3] == ["step", "prompt", "response"]
    assert [row[:2] for row in logged["data"]] == [[2, "0+1="], [2, "1+1="]]


def test_plot_png_has_labelled_axes(tmp_path):
    pytest.importorskip("matplotlib")
    from verl.tracking.plot import png_figure

    rows = [{"step": i, "reward/mean": i * 0.1, "actor/pg_loss": -i} for i in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, charts = plot_run(tmp_path)
    path = write_png(charts, "run", tmp_path / "metrics.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    axes = png_figure(charts, "run").axes
    assert [(a.get_xlabel(), a.get_ylabel(), a.get_title()) for a in axes] == [
        ("step", "reward/mean", "reward/mean"), ("step", "actor/pg_loss", "actor/pg_loss")]


def test_verl_plot_cli_writes_png_or_says_how_to_install_matplotlib(tmp_path):
    rows = [{"step": i, "reward/mean": i * 0.1} for i in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, "-m", "verl.cli", "plot", str(tmp_path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    assert f"wrote {tmp_path / 'metrics.svg'}" in text
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "no PNG: writing a PNG needs matplotlib" in text and "pip install matplotlib" in text
        assert "pip install -e '.[plot]'" in text and not (tmp_path / "metrics.png").exists()
    else:
        assert f"wrote {tmp_path / 'metrics.png'}" in text and (tmp_path / "metrics.png").is_file()


def test_write_png_without_matplotlib_is_a_verl_error(tmp_path):
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed here")
    except ImportError:
        pass
    with pytest.raises(VerlError, match=r"pip install matplotlib .*pip install -e '\.\[plot\]'"):
        write_png({"loss": [(1, 1.0)]}, "run", tmp_path / "m.png")
