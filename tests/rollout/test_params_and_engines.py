"""SamplingParams validation, the engine factory and the vLLM shim's missing-install error."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from verl.errors import ConfigError
from verl.rollout import VLLM_INSTALL_HINT, HFKVCacheEngine, SamplingParams, VLLMEngine, build_engine

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.n, p.eos_token_ids) == (1.0, 1.0, None, 1, [])
    assert p.resolved_pad_token_id == 0 and not p.greedy
    q = SamplingParams(temperature=0, eos_token_ids=7)
    assert q.eos_token_ids == [7] and q.resolved_pad_token_id == 7 and q.greedy
    assert SamplingParams(eos_token_ids=(4, 5), pad_token_id=1).resolved_pad_token_id == 1


def test_all_problems_reported_together():
    with pytest.raises(ConfigError) as err:
        SamplingParams(temperature=-1, top_p=0, top_k=-2, max_new_tokens=0, n=0, eos_token_ids=[-3], pad_token_id=-1)
    msg = str(err.value)
    for fragment in ("temperature must be >= 0 (0 = greedy), got -1", "top_p must be in (0, 1], got 0",
                     "top_k must be an int >= 0, got -2", "max_new_tokens must be an int >= 1, got 0",
                     "n (samples per prompt) must be an int >= 1, got 0", "eos_token_ids must be non-negative",
                     "pad_token_id must be a non-negative int or None, got -1"):
        assert fragment in msg


def test_top_p_above_one_rejected():
    with pytest.raises(ConfigError, match=r"top_p must be in \(0, 1\], got 1.5; use 1.0 to switch it off"):
        SamplingParams(top_p=1.5)


def test_build_engine_hf(qwen2):
    engine = build_engine("hf", qwen2)
    assert isinstance(engine, HFKVCacheEngine) and engine.model is qwen2


def test_build_engine_unknown_name_suggests():
    with pytest.raises(ConfigError, match=r"unknown rollout engine 'vlm'.*Did you mean 'vllm'\?"):
        build_engine("vlm", "some/path")


def test_build_engine_vllm_needs_a_path():
    with pytest.raises(ConfigError, match=r"needs the model's path or hub id"):
        build_engine("vllm", object())


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_vllm_missing_is_a_config_error_with_install_hint():
    # `verl` on the package index is another project: the hint names vllm itself, and the checkout's extra.
    assert VLLM_INSTALL_HINT == "pip install vllm (or, in a verl checkout: pip install -e '.[vllm]')"
    with pytest.raises(ConfigError,
                       match=r"needs the vllm package.*pip install vllm .*'\.\[vllm\]'.*rollout engine 'hf'"):
        VLLMEngine("/models/qwen")
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[vllm\]'"):
        build_engine("vllm", "/models/qwen")


@pytest.mark.slow
def test_importing_rollout_does_not_import_vllm():
    code = "import sys, verl.rollout; assert 'vllm' not in sys.modules; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
