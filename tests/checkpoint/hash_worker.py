"""One rank of the 2-process shared-hashing test (run by test_shared_hashing.py, not collected by pytest).

Each rank holds its own 1 MiB tensor (as an FSDP shard would be), saves step 1, then resolves the resume
checkpoint; every call of sha256_file is recorded, so the test sees which rank read which file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import verl.checkpoint.manager as manager  # noqa: E402
import verl.checkpoint.manifest as manifest  # noqa: E402
from verl.checkpoint import CheckpointManager  # noqa: E402
from verl.errors import CheckpointError  # noqa: E402


def main() -> None:
    rank, world, init_file, run_dir, phase = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    hashed: list[str] = []
    real = manifest.sha256_file

    def recording(path):
        hashed.append(Path(path).relative_to(Path(path).parents[1] if Path(path).parent.name in ("state", "extra")
                                             else Path(path).parent).as_posix())
        return real(path)

    manager.sha256_file = manifest.sha256_file = recording
    mgr = CheckpointManager(run_dir, save_interval=1, rank=rank, world_size=world)
    record: dict[str, object] = {}
    if phase == "save":
        torch.manual_seed(rank)
        mgr.save(1, app_state={"shards": {f"w{rank}": torch.randn(256, 1024)}}, extra={"rank": rank})
        record["save"] = sorted(hashed)
        hashed.clear()
        found = mgr.find_resume("auto")
        record["resume"] = sorted(hashed)
        record["found"] = str(found)
    else:  # after the test damaged a file: every rank reaches the same verdict
        record["auto"] = str(mgr.find_resume("auto"))
        try:
            mgr.find_resume(str(Path(run_dir) / "checkpoints" / "step_1"))
            record["explicit"] = "accepted"
        except CheckpointError as exc:
            record["explicit"] = str(exc)
    mgr.close()
    (Path(run_dir) / f"{phase}_rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
