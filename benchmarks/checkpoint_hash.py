"""Checkpoint save and resume-verify time with the hashing on rank 0 alone (as before) against shared by
the ranks (each hashes the shards it wrote at save, and its share at resume).

Run by hand (not a test):
    python benchmarks/checkpoint_hash.py [--scale 1.0] [--ranks 2]
The state is Qwen2.5-0.5B's parameter shapes (config only: hidden 896, 24 layers, MLP 4864, vocab 151936,
tied embeddings), random bfloat16 weights, each parameter split in two along dim 0 as FSDP2 shards it, on
--ranks gloo processes (1 torch thread each). `--scale 0.25` keeps a quarter of the layers and of the vocab
for a slow disk. Each way saves one checkpoint with CheckpointManager (DCP write + fsync + hashing +
manifest + commit), then resolves `trainer.resume` to it (every file re-hashed); the time is the slowest
rank's, the best of two rounds per way (in the order old, new, new, old). The files are in the page cache when
they are re-hashed (they were just written); on a cold network filesystem the hashing share of both times, and
so the gain, is larger. Printed: a table of seconds per way, then the ratios old/new (> 1: the shared hashing is
faster).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QWEN25_05B = {"hidden": 896, "layers": 24, "mlp": 4864, "vocab": 151936, "heads": 14, "kv_heads": 2}


def parameter_shapes(scale: float) -> dict[str, tuple[int, ...]]:
    """The parameters of Qwen2.5-0.5B (names as in transformers' Qwen2ForCausalLM), `scale` of its layers
    and vocabulary."""
    c = QWEN25_05B
    h, head = c["hidden"], c["hidden"] // c["heads"]
    kv = c["kv_heads"] * head
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (max(1, int(c["vocab"] * scale)), h)}
    for i in range(max(1, round(c["layers"] * scale))):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.q_proj.bias": (h,),
                   p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
                   p + "self_attn.o_proj.weight": (h, h), p + "mlp.gate_proj.weight": (c["mlp"], h),
                   p + "mlp.up_proj.weight": (c["mlp"], h), p + "mlp.down_proj.weight": (h, c["mlp"]),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    shapes["model.norm.weight"] = (h,)
    return shapes


def shard_state(scale: float, rank: int, world: int) -> dict[str, torch.Tensor]:
    """This rank's dim-0 shard of every parameter (random bfloat16), keyed per rank as FSDP2's DTensor
    shards land in their own rank's file."""
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for name, shape in parameter_shapes(scale).items():
        rows = torch.tensor_split(torch.arange(shape[0]), world)[rank].numel()
        out[f"{name}.shard{rank}"] = torch.randn((rows, *shape[1:]), generator=gen, dtype=torch.bfloat16)
    return out


def old_way(manager_cls) -> dict[str, object]:
    """The methods that make rank 0 hash every file at save and re-hash every file at resume (the others
    wait), to swap in for the shared ones."""
    from verl.checkpoint.manifest import verify

    def rank0_verify(self, path):
        return self._broadcast_object(verify(path) if self.rank == 0 else None)

    return {"_own_hashes": lambda self, tmp, extra_bytes: {}, "_verify": rank0_verify}


def worker(rank: int, world: int, port: int, scale: float, root: str, results: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    from verl.checkpoint import CheckpointManager

    state = {"model": shard_state(scale, rank, world)}
    ways = {"new": {name: getattr(CheckpointManager, name) for name in ("_own_hashes", "_verify")},
            "old": old_way(CheckpointManager)}
    best: dict[str, list[float]] = {}
    for i, way in enumerate(("old", "new", "new", "old")):  # ABBA: neither way gets the warm-up or the warm cache
        for name, method in ways[way].items():
            setattr(CheckpointManager, name, method)
        run_dir = Path(root) / f"{way}{i}"
        mgr = CheckpointManager(run_dir, save_interval=1, rank=rank, world_size=world)
        times = []
        for action in ("save", "verify"):
            dist.barrier()
            start = time.perf_counter()
            if action == "save":
                mgr.save(1, app_state=state, extra={"rank": rank})
            else:
                assert mgr.find_resume("auto") == run_dir / "checkpoints" / "step_1"
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(took.item())
        mgr.close()
        best[way] = [min(a, b) for a, b in zip(best.get(way, times), times, strict=True)]
        dist.barrier()
        if rank == 0:
            shutil.rmtree(run_dir, ignore_errors=True)  # free the disk before the next round writes
    if rank == 0:
        Path(results).write_text("\n".join(f"{way} {t[0]:.3f} {t[1]:.3f}" for way, t in best.items()))
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="fraction of the layers and vocabulary")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temp folder)")
    args = parser.parse_args()
    import torch.multiprocessing as mp

    numel = sum(torch.Size(s).numel() for s in parameter_shapes(args.scale).values())
    print(f"Qwen2.5-0.5B shapes x {args.scale:g}: {numel / 1e6:.0f}M parameters, bfloat16 "
          f"({numel * 2 / 2**30:.2f} GiB), {args.ranks} gloo ranks")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="verl-ckpt-hash-") as root:
        results = os.path.join(root, "results.txt")
        mp.start_processes(worker, args=(args.ranks, _free_port(), args.scale, root, results), nprocs=args.ranks,
                           join=True, start_method="fork" if sys.platform == "linux" else "spawn")
        rows = {w: [float(x) for x in rest]
                for w, *rest in (line.split() for line in Path(results).read_text().splitlines())}
    print("| hashing | save s | verify s |")
    print("|---|---|---|")
    print(f"| rank 0 hashes every file | {rows['old'][0]:.2f} | {rows['old'][1]:.2f} |")
    print(f"| each rank its own share | {rows['new'][0]:.2f} | {rows['new'][1]:.2f} |")
    print(f"ratio save (rank 0 alone / shared): {rows['old'][0] / rows['new'][0]:.2f}x; "
          f"verify: {rows['old'][1] / rows['new'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import doc_table

    raise SystemExit(doc_table.run(main, doc_table.table_and("ratio"), doc=doc_table.ROOT / "docs" / "training.md"))
