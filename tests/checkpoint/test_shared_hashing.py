"""Checkpoint hashing is shared by the ranks: at save each rank hashes the files it wrote (rank 0 gathers
the hashes into the manifest), at resume each re-hashes its share; a damaged file is still found, by
whichever rank reads it, and every rank then decides the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl.checkpoint import verify

WORKER = Path(__file__).with_name("hash_worker.py")


def _run(tmp_path: Path, phase: str) -> list[dict]:
    run = tmp_path / "run"
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(tmp_path / f"init-{phase}"), str(run),
                               phase], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [json.loads((run / f"{phase}_rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.dist
@pytest.mark.slow  # two pairs of processes: ~20 s on an idle 2-core machine
def test_each_rank_hashes_its_own_shards_and_damage_is_still_found(tmp_path):
    ranks = _run(tmp_path, "save")
    step1 = tmp_path / "run" / "checkpoints" / "step_1"
    assert verify(step1) == []  # the gathered hashes are the files' hashes
    files = json.loads((step1 / "manifest.json").read_text())["files"]
    shards = {r: [f for f in files if f.startswith(f"state/__{r}_")] for r in (0, 1)}
    assert shards[0] and shards[1]
    # save: rank 0 never reads rank 1's shard or extra file; rank 1 hashed them itself
    assert not set(ranks[0]["save"]) & {*shards[1], "extra/rank_00001.pt"}
    assert {*shards[1], "extra/rank_00001.pt"} <= set(ranks[1]["save"])
    # resume: the two ranks read disjoint shares that together cover every file
    assert not set(ranks[0]["resume"]) & set(ranks[1]["resume"])
    assert set(ranks[0]["resume"]) | set(ranks[1]["resume"]) == set(files)
    assert ranks[0]["found"] == ranks[1]["found"] == str(step1)

    victim = step1 / sorted(ranks[1]["resume"], key=lambda f: files[f]["size"])[-1]  # rank 1's largest
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only a hash finds it
    victim.write_bytes(bytes(data))
    after = _run(tmp_path, "damaged")
    assert after[0]["auto"] == after[1]["auto"] == "None"  # no good checkpoint: both start fresh
    for record in after:  # both refuse the explicit path, naming the file rank 1 found damaged
        assert f"{victim}: sha256" in record["explicit"] and "the file is corrupt" in record["explicit"]
