"""The FSDP2-sharded critic: its gradient on 2 gloo ranks equals one process on the whole batch, and its
output is not a view (FSDP2 hooks a view's autograd node, which an in-place op on the view replaces)."""

import _dist_workers as W  # noqa: E402 - pytest puts tests/distributed on sys.path
import pytest
import torch

pytestmark = pytest.mark.dist


def test_fsdp_critic_gradient_on_two_ranks_equals_one_process_and_output_is_not_a_view(tmp_path):
    W.launch(W.critic_grad_worker, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"critic{r}.pt", weights_only=False) for r in range(2)]

    for r, res in enumerate(ranks):
        view_warnings = [m for m in res["warnings"] if "view" in m]
        assert view_warnings == [], f"rank {r}: {view_warnings}"

    reference = ranks[0]["reference"]
    assert reference["value_head.weight"].abs().sum() > 0
    backbone = [k for k in reference if k.startswith("backbone.")]
    assert backbone and all(reference[k] is not None for k in backbone)
    assert sum(float(reference[k].abs().sum()) for k in backbone) > 0  # the comparison is not vacuous
    for run in ("sharded", "in_place"):
        grads = ranks[0][run]
        assert grads.keys() == reference.keys()
        for name, ref in reference.items():
            got = grads[name]
            if ref is None:
                assert got is None, name
                continue
            # float32, 1e-6 relative to the tensor's scale (elementwise rtol alone fails on entries that are
            # mathematically zero, e.g. the attention key bias, where both runs hold rounding noise)
            scale = float(ref.abs().max())
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6 * scale,
                                       msg=lambda m, n=name, r=run: f"{r} {n}: {m}")
