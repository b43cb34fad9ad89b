"""reward.executor=process: per-sample reward calls in worker processes score exactly as on threads, a
call past the timeout is killed with its worker (not abandoned), a worker that dies fails only its sample,
and functions a worker cannot get are refused at start-up with the fix."""

from __future__ import annotations

import os
import sys
import textwrap
import time

import pytest
import torch

from verl.errors import ConfigError, RewardError
from verl.rewards import RewardManager

PROMPTS = ["p0", "p1", "p2", "p3"]
RESPONSES = ["1", "22", "x", "4"]
GROUND_TRUTHS = ["1", "2", "3", "4"]

REWARDS = textwrap.dedent('''
    import os, time

    def digits(prompt, response, ground_truth, scale=1.0, **meta):
        """Per-sample, with metadata and a spec kwarg; a dict return with a text extra."""
        return {"score": scale * sum(c.isdigit() for c in response) / len(response), "pid": str(os.getpid())}

    def pid(prompt, response, ground_truth, **meta):
        return float(os.getpid())

    def sleepy(prompt, response, ground_truth, seconds=0.0, **meta):
        time.sleep(float(meta.get("sleep", seconds)))
        return 1.0

    def crash(prompt, response, ground_truth, **meta):
        if response == "x":
            os._exit(3)
        return 1.0

    def broken(prompt, response, ground_truth, **meta):
        return 1 / (response != "x")

    def sandbox_defaults(prompt, response, ground_truth, **meta):
        from verl.sandbox.isolation import DEFAULTS
        return float(DEFAULTS["require"] == ("tmp",))

    def each(prompts, responses, ground_truths, metas):
        return [float(os.getpid()) for _ in responses]
''')


@pytest.fixture
def rewards(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    return f"{tmp_path / 'rewards.py'}"


def manager(specs, executor="process", workers=2, timeout_s=30.0):
    m = RewardManager(specs)
    m.configure(workers=workers, timeout_s=timeout_s, executor=executor)
    return m


def test_process_scores_equal_thread_scores(rewards):
    specs = [{"name": f"{rewards}:digits", "kwargs": {"scale": 2.0}}, {"name": "numeric_match", "weight": 0.5},
             {"name": f"{rewards}:each", "batched": True, "weight": 0.0}]
    metadata = [{"extra": i} for i in range(4)]
    results = {ex: manager(specs, ex).score(PROMPTS, RESPONSES, GROUND_TRUTHS, metadata)
               for ex in ("thread", "process")}
    thread, process = results["thread"], results["process"]
    assert torch.equal(thread.scores, process.scores)
    assert {k: v for k, v in thread.metrics.items()} == process.metrics
    assert torch.equal(thread.applied["digits"], process.applied["digits"])
    # the per-sample function ran in other processes, the batched one in this one
    pids = {int(e["digits"]["pid"]) for e in process.extras}
    assert os.getpid() not in pids and len(pids) >= 1
    assert process.per_function["each"].tolist() == [float(os.getpid())] * 4


def test_a_call_past_the_timeout_is_killed_and_the_pool_goes_on(rewards):
    m = manager([{"name": f"{rewards}:sleepy"}], timeout_s=1.5)
    pool = m.sample_pool
    m.score(PROMPTS[:1], ["warm"], GROUND_TRUTHS[:1])  # the workers have started
    hung = {w.process.pid for w in pool._workers}
    start = time.monotonic()
    result = m.score(PROMPTS, RESPONSES, GROUND_TRUTHS, [{"sleep": 60}, {}, {}, {}])
    assert time.monotonic() - start < 20
    assert result.scores.tolist() == [0.0, 1.0, 1.0, 1.0]
    assert result.metrics["reward/timeouts"] == 1.0
    assert result.extras[0]["sleepy"]["status"] == "timeout"
    killed = hung - {w.process.pid for w in pool._workers}
    assert len(killed) == 1
    for pid in killed:  # gone, not left sleeping
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
    assert m.score(PROMPTS, RESPONSES, GROUND_TRUTHS).scores.tolist() == [1.0] * 4


def test_a_worker_that_dies_fails_only_its_sample(rewards):
    """(More in test_reward_worker_crashes.py.)"""
    m = manager([{"name": f"{rewards}:crash"}])
    result = m.score(PROMPTS, RESPONSES, GROUND_TRUTHS)
    assert result.scores.tolist() == [1.0, 1.0, 0.0, 1.0]
    assert "died (exit code 3)" in result.extras[2]["crash"]["reason"]
    assert m.score(PROMPTS[:2], RESPONSES[:2], GROUND_TRUTHS[:2]).scores.tolist() == [1.0, 1.0]


def test_a_worker_that_died_while_idle_is_replaced_without_failing_a_call(rewards):
    m = manager([{"name": f"{rewards}:pid"}], workers=1)
    first = m.score(PROMPTS[:1], RESPONSES[:1], GROUND_TRUTHS[:1]).scores.tolist()
    os.kill(int(first[0]), 9)  # the OOM killer, say, between two batches
    os.waitpid(int(first[0]), 0)
    second = m.score(PROMPTS, RESPONSES, GROUND_TRUTHS).scores.tolist()
    assert len(set(second)) == 1 and second[0] != first[0]


def test_a_raising_function_names_the_sample_and_the_line(rewards):
    m = manager([{"name": f"{rewards}:broken"}])
    with pytest.raises(RewardError,
                       match=r"(?s)'broken' .* raised ZeroDivisionError.* on sample 2.*rewards.py\", line"):
        m.score(PROMPTS, RESPONSES, GROUND_TRUTHS)


def test_calls_run_at_once_up_to_the_workers(rewards):
    m = manager([{"name": f"{rewards}:sleepy", "kwargs": {"seconds": 0.5}}], workers=4)
    m.score(PROMPTS, RESPONSES, GROUND_TRUTHS)  # start-up
    start = time.monotonic()
    m.score(PROMPTS, RESPONSES, GROUND_TRUTHS)
    assert time.monotonic() - start < 1.5  # four half-second calls at once, not 2 s one after another


def test_an_importable_callable_is_pickled_to_the_workers(tmp_path, monkeypatch):
    (tmp_path / "importable_reward.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importable_reward

    result = manager([importable_reward.pid]).score(PROMPTS, RESPONSES, GROUND_TRUTHS)
    assert os.getpid() not in result.scores.tolist()


def test_functions_a_worker_cannot_get_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="cannot be pickled.*reward.executor=thread"):
        manager([lambda prompt, response, ground_truth: 1.0])

    def local(prompt, response, ground_truth):
        return 1.0

    with pytest.raises(ConfigError, match="cannot be pickled"):
        manager([local])
    main = type(sys)("__main__")
    exec("def score(prompt, response, ground_truth):\n    return 1.0", main.__dict__)
    with pytest.raises(ConfigError, match=r"__main__"):
        manager([main.score])
    m = manager([lambda prompt, response, ground_truth: 1.0], executor="thread")  # threads take any callable
    assert m.sample_pool is None
    with pytest.raises(ConfigError, match="reward.executor must be 'thread' or 'process', got 'processes'"):
        manager([lambda prompt, response, ground_truth: 1.0], executor="processes")


def test_closing_the_pool_ends_its_workers(rewards):
    m = manager([{"name": f"{rewards}:pid"}])
    pids = {int(s) for s in m.score(PROMPTS, RESPONSES, GROUND_TRUTHS).scores.tolist()}
    m.sample_pool.close()
    for pid in pids:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_workers_get_the_sandbox_settings(rewards, monkeypatch):
    from verl.sandbox.isolation import DEFAULTS

    monkeypatch.setitem(DEFAULTS, "require", ("tmp",))  # what `sandbox.require` set at start-up
    assert manager([{"name": f"{rewards}:sandbox_defaults"}]).score(
        PROMPTS, RESPONSES, GROUND_TRUTHS).scores.tolist() == [1.0] * 4


def test_workers_end_with_the_trainer_even_mid_call(rewards, tmp_path):
    """A trainer killed while a call runs (no clean-up of its own) leaves no worker behind."""
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f'''
        import os
        from verl.rewards import RewardManager
        m = RewardManager([{{"name": {rewards!r} + ":sleepy", "kwargs": {{"seconds": 60}}}}])
        m.configure(executor="process", workers=1)
        m.sample_pool.submit([(0, (0, "p", "r", "g", {{}}, None))])
        print(m.sample_pool._workers[0].process.pid, flush=True)
        os._exit(0)
    '''))
    import subprocess

    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    worker = int(out.stdout.split()[0])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"worker {worker} outlived its trainer")
