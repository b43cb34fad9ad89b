"""The weight push into vLLM gathers each FSDP2 shard on the rank's device and in the dtype the engine holds.

`policy_weights(model, dtype=bfloat16)` moves every local shard to the rank's device and casts it before the
all-gather: with `cpu_offload` (shards on the CPU) nothing float32 crosses gloo any more, and a push moves
parameters x 2 bytes. Checked on 2 gloo ranks with the marker device of collective_check.py (a tensor handed
to the gather must have been made on the role's device), a byte counter on the gather, and the values
against the unsharded model's (LoRA: merged in float32, then cast)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dist_workers as W  # noqa: E402
from collective_check import MARKER, check_collective_devices  # noqa: E402

pytestmark = pytest.mark.dist


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from verl.config.schema import LoraConfig
    from verl.models.lora import apply_lora

    wrapped = apply_lora(model, LoraConfig(rank=4))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:  # a trained adapter (B starts at zero)
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return wrapped


def _push_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from verl.config.fsdp import FSDPConfig
    from verl.distributed.fsdp import apply_fsdp
    from verl.models.lora import base_of
    from verl.rollout.weight_sync import policy_weights

    W.setup(rank, world, port)
    gathers: list[tuple[torch.dtype, int]] = []
    real = dist.all_gather_into_tensor

    def counted(output, input, *args, **kwargs):  # the bytes each gather brings in
        gathers.append((output.dtype, output.numel() * output.element_size()))
        return real(output, input, *args, **kwargs)

    dist.all_gather_into_tensor = counted  # under the check's wrapper, which sees verl as the caller
    result: dict[str, object] = {}
    try:
        for offload in (False, True):
            for lora in (False, True):
                whole = _lora(W.tiny_qwen2()) if lora else W.tiny_qwen2()
                want = (dict(whole.merge_and_unload().state_dict()) if lora
                        else {n: p.detach().clone() for n, p in whole.named_parameters()})
                model = _lora(W.tiny_qwen2()) if lora else W.tiny_qwen2()
                apply_fsdp(base_of(model), FSDPConfig(cpu_offload=offload))
                held = {p.to_local().device.type for p in model.parameters()}
                gathers.clear()
                with check_collective_devices() as check:
                    pushed = dict(policy_weights(model, device=MARKER, dtype=torch.bfloat16))
                result[f"offload={offload},lora={lora}"] = {
                    "held_on": held, "checked": check.checked, "violations": list(check.violations),
                    "gathers": list(gathers), "pushed": pushed, "want": want,
                    "params": sum(t.numel() for t in pushed.values())}
    finally:
        dist.all_gather_into_tensor = real
    torch.save(result, Path(out_dir) / f"push{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow  # ~10 s: two forked gloo ranks
def test_push_gathers_on_the_device_in_the_rollout_dtype(tmp_path):
    W.launch(_push_worker, 2, str(tmp_path))
    for rank in (0, 1):
        result = torch.load(tmp_path / f"push{rank}.pt", weights_only=False)
        assert set(result) == {f"offload={o},lora={lo}" for o in (False, True) for lo in (False, True)}
        for case, r in result.items():
            assert r["held_on"] == {"cpu"}, case
            # every gather's tensors were made on the rank's device (what NCCL needs) ...
            assert r["checked"] == len(r["gathers"]) > 0 and r["violations"] == [], (case, r["violations"])
            # ... in bfloat16: a push brings in parameters x 2 bytes (tiny_qwen2's dim 0 splits evenly)
            assert {dtype for dtype, _ in r["gathers"]} == {torch.bfloat16}, case
            assert sum(n for _, n in r["gathers"]) == 2 * r["params"], case
            assert set(r["pushed"]) == set(r["want"]), case
            for name, tensor in r["pushed"].items():
                assert tensor.dtype == torch.bfloat16, (case, name)
                if case.endswith("lora=False"):  # the old path cast to bfloat16, bit for bit
                    assert torch.equal(tensor, r["want"][name].to(torch.bfloat16)), (case, name)
                else:  # merged in float32, then cast: within bfloat16's rounding of the merged weight
                    torch.testing.assert_close(tensor, r["want"][name].to(torch.bfloat16), rtol=2**-8, atol=1e-6)
