"""Per-rank peak memory of a run's start-up: `verl train`'s set-up (the trainer constructed, stopped before
its first step) on N CPU ranks (torchrun, gloo), with each rank's peak resident set (VmHWM) reported back.

The sharded start-up (`verl.models.sharded_load`) builds each role on the meta device, shards it, and
has each rank read only its rows of the weight files; the old path (`--old` forces it: every rank loads
every model whole, then shards it) is measured in the same run, with fewer ranks or roles where N whole
copies per rank would not fit the machine. Run by hand (the ~1B model is built once, under ~/.cache/verl):
``python benchmarks/startup_memory.py [--model tiny:qwen2:2048:16 --nproc 4 --old-nproc 4] [--write-docs]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import doc_table  # noqa: E402

ROLES = {"policy": [], "policy+ref+critic": ["actor.kl_loss_coef=0.01", "algorithm.adv_estimator=gae"]}


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(args: argparse.Namespace) -> int:
    """One rank: construct the trainer as `verl train` does, then report this process's peak RSS."""
    import torch

    from verl import RLTrainer
    from verl.config import load_config
    from verl.models.sharded_load import bytes_read
    from verl.trainer.compose import components

    if args.old:
        components.sharded_start = lambda config, process: False  # every model loaded whole, then sharded
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(overrides=[
            f"model.path={args.model}", "model.dtype=float32", "env.name=arithmetic", "trainer.device=cpu",
            "trainer.total_steps=1", f"trainer.run_dir={run_dir}", "trainer.cpu_threads=1",
            "data.train_batch_size=8", "data.max_prompt_length=16", "rollout.n=2", "rollout.max_new_tokens=4",
            "actor.micro_batch_size=2", "logging.backends=[jsonl]", *ROLES[args.roles]])
        trainer = RLTrainer(config)
        rank = int(os.environ.get("RANK", 0))
        shards = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in trainer.model.parameters())
        out = {"rank": rank, "peak_rss": _peak_rss(), "bytes_read": bytes_read(), "policy_local_params": shards}
        Path(args.worker, f"rank{rank}.json").write_text(json.dumps(out))
    return 0


def measure(model: str, nproc: int, roles: str, old: bool) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               __file__, "--worker", out, "--model", model, "--roles", roles, *(["--old"] if old else [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        return sorted((json.loads(p.read_text()) for p in Path(out).glob("rank*.json")), key=lambda r: r["rank"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny:qwen2:2048:16")
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--old-nproc", type=int, default=4, help="ranks for the old path, policy only")
    parser.add_argument("--old-roles-nproc", type=int, default=2,
                        help="ranks for the old path with a reference and a critic (two more whole copies per rank)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--roles", default="policy", choices=list(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--old", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from verl.trainer.build.models import resolve_model_path

    path = Path(resolve_model_path(args.model))  # built once here, not by every rank
    full = sum(f.stat().st_size for f in path.glob("*.safetensors"))  # the float32 file: one whole copy
    gib = 2**30
    print(f"{args.model}: one full float32 copy {full / gib:.2f} GiB; CPU ranks (gloo), peak RSS per rank "
          "(VmHWM) from start to the trainer built (before the first step)")
    print("| start-up | ranks | roles | peak RSS per rank (GiB) | / full copy | read per rank (GiB) |")
    print("|---|---|---|---|---|---|")
    runs = [("sharded", args.nproc, "policy", False), ("sharded", args.nproc, "policy+ref+critic", False),
            ("old", args.old_nproc, "policy", True), ("old", args.old_roles_nproc, "policy+ref+critic", True)]
    peaks = {}
    for name, nproc, roles, old in runs:
        ranks = measure(args.model, nproc, roles, old)
        peak = max(r["peak_rss"] for r in ranks)
        peaks[(name, roles)] = peak
        per_rank = ", ".join(f"{r['peak_rss'] / gib:.2f}" for r in ranks)
        print(f"| {name} | {nproc} | {roles} | {per_rank} | "
              f"{peak / full:.2f}x | {max(r['bytes_read'] for r in ranks) / gib:.2f} |", flush=True)
    new, extra = peaks[("sharded", "policy")], peaks[("sharded", "policy+ref+critic")]
    old, old_extra = peaks[("old", "policy")], peaks[("old", "policy+ref+critic")]
    print(f"ratio peak RSS per rank / one full fp32 copy ({full / gib:.2f} GiB): sharded start-up {new / full:.2f}x "
          f"({args.nproc} ranks, policy), {extra / full:.2f}x with a reference and a critic "
          f"(+{(extra - new) / full:.2f}x for two shards of {1 / args.nproc:.2f}x); "
          f"old path {old / full:.2f}x ({args.old_nproc} ranks, policy: "
          f"from_pretrained maps the file and sharding touches only this rank's pages on a CPU), "
          f"{old_extra / full:.2f}x with a reference and a critic ({args.old_roles_nproc} ranks: their whole copies "
          f"on {args.nproc} ranks do not fit this machine's memory)")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv:
        raise SystemExit(main())
    raise SystemExit(doc_table.run(main, doc_table.table_and("ratio"), doc=doc_table.ROOT / "docs" / "multigpu.md"))
