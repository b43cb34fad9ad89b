"""Start-up checks of where a run reads and writes: model sources (`tiny`, hub ids while offline), the
run folder and the logging backends; each fails in seconds with what, where and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from rl_support import rl_config  # pytest puts this folder on sys.path

from verl.trainer.rl_trainer import RLTrainer


def test_critic_and_reward_model_accept_tiny(tmp_path):
    """`critic.path=tiny` / `reward.model_path=tiny` build locally as `model.path=tiny` does (the reward model
    with a one-label score head), instead of a hub look-up for a repository called `tiny`."""
    cfg = rl_config(tmp_path / "run", "algorithm.adv_estimator=gae", "critic.path=tiny",
                    "reward.model_path=tiny", "reward.model_weight=0.5", reward={"name": "numeric_match"})
    trainer = RLTrainer(cfg)
    assert type(trainer.critic).__name__ == "ValueModel"
    rm = trainer.env.reward_manager
    assert rm.names == ["numeric_match", "reward_model"]
    scorer = next(ld.fn for ld in rm._loaded if ld.label == "reward_model").scorer
    assert scorer.model.config.num_labels == 1 and Path(scorer.source).is_dir()
    assert scorer.score_texts(["1+1=2"]).shape == (1,)


HUB_ID = "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """A Hugging Face cache with nothing in it, and the hub at a local port that refuses connections."""
    import socket

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as sock:  # a port nobody listens on: the connection is refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    return tmp_path / "hf" / "hub"


def test_offline_hub_id_fails_in_seconds_with_the_fix(empty_hub_cache, monkeypatch, capsys):
    """A hub id that is not cached, with HF_HUB_OFFLINE=1: one start-up problem naming the key and the
    download command, instead of a minute of retries; nothing is loaded."""
    import time

    from verl.cli.main import main
    from verl.demos.arithmetic import demo_config_path

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    assert main(["check", demo_config_path(), f"model.path={HUB_ID}", "trainer.demo=null",
                 "env.name=arithmetic"]) == 1
    seconds = time.perf_counter() - start
    out = capsys.readouterr().out
    assert out.count("problem:") == 1, out
    assert (f"problem: model.path={HUB_ID} is a Hugging Face hub id that is not on this machine" in out
            and str(empty_hub_cache) in out and "HF_HUB_OFFLINE=1 forbids downloading it" in out
            and f"`huggingface-cli download {HUB_ID}`" in out and "set model.path to a local folder" in out)
    assert "skipped: the start-up problems come first: nothing was loaded" in out
    assert seconds < 30  # the demo's data and environment are still checked; the hub part takes no time


def test_unreachable_hub_is_probed_once(empty_hub_cache, monkeypatch):
    """Without HF_HUB_OFFLINE one short HEAD request decides, for every key naming a hub id; a refused
    connection is reported with the endpoint."""
    import time

    from verl.config import load_config
    from verl.trainer.checks import source_checks

    calls = []
    probe = source_checks.probe_hub
    monkeypatch.setattr(source_checks, "probe_hub", lambda *a, **k: calls.append(a) or probe(*a, **k))
    cfg = load_config(overrides=[f"model.path={HUB_ID}", "algorithm.adv_estimator=gae", "critic.path=org/critic",
                                 "reward.model_path=org/rm", "reward.functions=[]"])
    start = time.perf_counter()
    problems, warnings = source_checks.check_model_sources(cfg, "rl")
    assert time.perf_counter() - start < source_checks.HUB_PROBE_TIMEOUT_S + 1 and len(calls) == 1
    assert [str(p).split(" is a ")[0] for p in problems] == [f"model.path={HUB_ID}", "critic.path=org/critic",
                                                             "reward.model_path=org/rm"]
    assert "the hub cannot be reached (http://127.0.0.1:" in str(problems[0]) and not warnings
    assert "set critic.path to a local folder" in str(problems[1])


def test_cached_hub_id_passes_offline_and_warns_when_the_hub_is_unreachable(empty_hub_cache, monkeypatch):
    from verl.config import load_config
    from verl.trainer.checks.source_checks import check_model_sources

    (empty_hub_cache / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc").mkdir(parents=True)
    cfg = load_config(overrides=[f"model.path={HUB_ID}"])
    problems, warnings = check_model_sources(cfg, "rl")
    assert not problems and len(warnings) == 1 and "Fix: set HF_HUB_OFFLINE=1" in str(warnings[0])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert check_model_sources(cfg, "rl") == ([], [])


def test_local_paths_and_tiny_are_never_probed(tmp_path, monkeypatch):
    from verl.config import load_config
    from verl.trainer.checks import source_checks

    monkeypatch.setattr(source_checks, "probe_hub", lambda *a, **k: pytest.fail("probed the hub"))
    (tmp_path / "org" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(overrides=["model.path=org/model", "ref.path=tiny:llama", "actor.kl_loss_coef=0.1",
                                 f"model.tokenizer_path={tmp_path}"])
    assert source_checks.check_model_sources(cfg, "rl") == ([], [])


def test_run_dir_under_a_file_is_a_start_up_problem(tmp_path, capsys):
    """`verl train` with a run folder that cannot be created stops at start-up with the folder and the fix,
    not with a traceback from the first write after the model loaded."""
    from verl.cli.main import main

    (tmp_path / "prompts.jsonl").write_text("".join(f'{{"prompt": "{a}+1=", "ground_truth": "{a + 1}"}}\n'
                                                    for a in range(4)), encoding="utf-8")
    (tmp_path / "afile").write_text("x", encoding="utf-8")
    assert main(["train", "model.path=tiny", f"data.train_files=[{tmp_path / 'prompts.jsonl'}]",
                 "data.train_batch_size=4", "reward.functions=[{name: numeric_match}]", "trainer.total_steps=1",
                 f"trainer.run_dir={tmp_path / 'afile' / 'run'}", "trainer.resume=never"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error (ConfigError): start-up checks failed (nothing was loaded)")
    assert (f"trainer.run_dir={tmp_path / 'afile' / 'run'} cannot be created: {tmp_path / 'afile'} is a file, "
            "not a folder. Fix: set trainer.run_dir to a folder you can write") in err


def test_run_dir_check_leaves_nothing_behind(tmp_path):
    from verl.config import load_config
    from verl.trainer.checks.startup import check_run_dir

    assert check_run_dir(load_config(overrides=[f"trainer.run_dir={tmp_path / 'a' / 'b'}"])) == []
    assert list(tmp_path.iterdir()) == []  # probed with a temporary folder in tmp_path, removed again
    (tmp_path / "run").mkdir()
    assert check_run_dir(load_config(overrides=[f"trainer.run_dir={tmp_path / 'run'}"])) == []
    assert list((tmp_path / "run").iterdir()) == []


@pytest.mark.skipif(not Path("/sys/kernel").is_dir(), reason="needs a read-only /sys (Linux)")
def test_run_dir_in_a_read_only_folder(tmp_path):
    """/sys refuses new entries even for root, where a chmod-ed folder would not."""
    from verl.config import load_config
    from verl.trainer.checks.startup import check_run_dir

    problems = check_run_dir(load_config(overrides=["trainer.run_dir=/sys/kernel/verl-run/x"]))
    assert len(problems) == 1 and str(problems[0]).startswith(
        "trainer.run_dir=/sys/kernel/verl-run/x is not writable: /sys/kernel, where it would be created, refuses "
        "new files (") and "Fix: set trainer.run_dir to a folder you can write" in str(problems[0])


def test_a_proxy_error_counts_as_unreachable_and_a_missing_repo_does_not(monkeypatch):
    """A proxy in front of no network answers 502/503; a 404/401 is the hub itself (the loader explains it)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from verl.trainer.checks.source_checks import probe_hub

    class Handler(BaseHTTPRequestHandler):
        def do_HEAD(self):  # noqa: N802
            self.send_response(503 if "proxy" in self.path else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        assert "HTTP 503" in probe_hub("proxy/model")
        assert probe_hub("org/missing") is None
    finally:
        server.shutdown()
