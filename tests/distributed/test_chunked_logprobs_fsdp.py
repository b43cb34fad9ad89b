"""Chunked log-probs (`actor.chunked_logprobs`) under FSDP2 on 2 gloo ranks: the head's weight is read while
FSDP2 holds it gathered, and its gradient (tied to the embedding) reaches the reduce-scatter; every parameter's
gradient equals one unsharded process running the plain logits on the whole batch, unshared, with shared
prompts and packed without padding (actor.remove_padding); without gradients (a reference's pass) the capture reshards
the head itself; LoRA adapters on the sharded model get one plain process's gradients."""

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import pytest
import torch

pytestmark = pytest.mark.dist


def test_chunked_logprobs_of_a_sharded_tied_policy_equal_one_plain_process(tmp_path):
    W.launch(W.chunked_logprob_worker, 2, str(tmp_path))
    result = torch.load(tmp_path / "chunked0.pt", weights_only=False)
    for shared in (False, True, "packed"):
        reference, got = result[f"reference{shared}"], result[f"chunked{shared}"]
        assert got.keys() == reference.keys() and "model.embed_tokens.weight" in got
        assert float(reference["model.embed_tokens.weight"].abs().max()) > 0
        for name, ref in reference.items():
            assert ref is not None and got[name] is not None, name
            scale = float(ref.abs().max())
            torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-5 * scale,
                                       msg=lambda m, n=name, s=shared: f"shared={s} {n}: {m}")
        assert result[f"gathered_after_backward{shared}"] is False  # FSDP2's backward resharded the head
    got, want = result["no_grad"]  # (the sharded model after its updates-free backward: the same weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert result["gathered_after_no_grad"] is False
    reference, got = result["lora_reference"], result["lora_chunked"]  # LoRA adapters over the sharded model
    assert reference and got.keys() == reference.keys() and all("lora_" in n for n in reference)
    for name, ref in reference.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()), msg=name)
