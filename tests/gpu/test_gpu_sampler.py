"""Our sampler on CUDA: greedy output equals `model.generate` in float32 and in bfloat16, the
preallocated (static) KV cache is used, and (where this build has `rollout.compile`) the compiled decode
step gives the same tokens. Marked `gpu`; skipped where CUDA is absent."""

from __future__ import annotations

import inspect

import pytest
import torch

from tests.rollout.conftest import left_padded, make_model
from verl.rollout import HFKVCacheEngine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS = [7, 3, 5, 1, 6, 2, 9, 4]
MAX_NEW = 24


def _cuda_model(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    return make_model(arch, seed=1).to(device="cuda", dtype=dtype).eval()


def _hf_greedy(model, ids, mask) -> torch.Tensor:
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW,
                         min_new_tokens=MAX_NEW, pad_token_id=0)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("fast_decode", [True, False], ids=["fast-decode", "model-forward"])
def test_greedy_equals_hf_generate_on_cuda(arch, dtype, fast_decode):
    model = _cuda_model(arch, dtype)
    ids, mask = (t.cuda() for t in left_padded(LENGTHS, seed=2))
    engine = HFKVCacheEngine(model, fast_decode=fast_decode)
    out = engine.generate(ids, mask, SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    assert out.response_ids.device.type == "cuda"
    assert torch.equal(out.response_ids, _hf_greedy(model, ids, mask))
    assert out.logprobs.dtype == torch.float32 and bool(torch.isfinite(out.logprobs).all())


def test_bf16_sampled_logprobs_match_a_full_forward_on_cuda():
    model = _cuda_model("qwen2", torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded(LENGTHS, seed=3))
    params = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW)
    out = HFKVCacheEngine(model).generate(ids, mask, params, torch.Generator(device="cuda").manual_seed(0))
    with torch.no_grad():
        logits = model(out.sequences, attention_mask=out.attention_mask, position_ids=out.position_ids).logits
    logp = torch.log_softmax(logits[:, ids.shape[1] - 1:-1].float(), -1)
    want = logp.gather(-1, out.response_ids.unsqueeze(-1)).squeeze(-1) * out.response_mask
    diff = (want - out.logprobs).abs()[out.response_mask.bool()]
    assert float(diff.mean()) < 0.02  # bf16 prefill/decode vs one full forward: rounding only


def test_compiled_decode_step_gives_the_same_tokens_on_cuda():
    if "compile" not in inspect.signature(HFKVCacheEngine.__init__).parameters:
        pytest.skip("this build's HFKVCacheEngine has no compile option (rollout.compile) yet")
    model = _cuda_model("qwen2", torch.bfloat16)
    ids, mask = (t.cuda() for t in left_padded(LENGTHS, seed=2))
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW)
    eager = HFKVCacheEngine(model).generate(ids, mask, params)
    compiled_engine = HFKVCacheEngine(model, compile=True)
    for _ in range(2):  # the second call replays what the first compiled/captured
        compiled = compiled_engine.generate(ids, mask, params)
        assert torch.equal(compiled.response_ids, eager.response_ids)
