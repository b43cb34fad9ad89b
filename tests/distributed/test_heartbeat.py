"""A rank that stops answering is named by the others within devices.heartbeat_s, with its last stage and
step, long before the collective waiting for it times out (2 gloo ranks, one SIGSTOPped)."""

from __future__ import annotations

import json
import signal
import sys

import pytest
import torch.distributed as dist
from _dist_workers import launch
from _heartbeat_worker import worker

from verl.config.schema import DevicesConfig
from verl.distributed.heartbeat import Heartbeat


@pytest.mark.dist
@pytest.mark.skipif(not hasattr(signal, "SIGSTOP") or sys.platform == "win32", reason="needs SIGSTOP")
def test_a_stopped_rank_is_named_within_heartbeat_s(tmp_path):
    launch(worker, 2, str(tmp_path))
    rec0 = json.loads((tmp_path / "heartbeat0.json").read_text())
    rec1 = json.loads((tmp_path / "heartbeat1.json").read_text())
    silent = [m for m in rec0["messages"] if "no heartbeat" in m]
    assert len(silent) == 1, rec0["messages"]  # once per silent episode, not once per beat
    assert f"rank 1 (pid {rec0['pid1']} on " in silent[0]
    assert "past its last collective 'reduce:sum', step 7" in silent[0]
    assert "devices.heartbeat_s=2" in silent[0] and "devices.timeout_s=30s" in silent[0]
    assert "Fix:" in silent[0] and f"kill -CONT {rec0['pid1']}" in silent[0]
    # named within heartbeat_s (2 s) of the stop (1 s after rank 0 began waiting), before the collective's timeout
    assert rec0["silent_after_s"] < rec0["timeout_after_s"], rec0
    # the collective's timeout still comes, and carries what the heartbeat knows of the missing rank
    assert rec0["timeout"].startswith("collective timeout at stage 'after_stop' (group [0, 1], call #0) on rank 0: "
                                      "rank(s) [1] did not arrive within 7s"), rec0["timeout"]
    assert f"Heartbeats: rank 1 (pid {rec0['pid1']} on " in rec0["timeout"]
    assert "silent, last heartbeat" in rec0["timeout"] and "'reduce:sum', step 7" in rec0["timeout"]
    assert any("rank 1 answers again" in m for m in rec0["messages"]), rec0["messages"]
    # the stopped rank, resumed, does not take the others for silent: their beats moved on meanwhile
    assert not [m for m in rec1["messages"] if "no heartbeat" in m], rec1["messages"]


def test_silence_is_said_once_a_comeback_once_and_an_exit_never():
    """Three ranks' monitors over one in-memory store, on a clock the test moves."""
    store, now = dist.HashStore(), [0.0]
    beats = [Heartbeat(10, store=store, rank=r, world_size=3, timeout_s=600, log=lambda m: None,
                       clock=lambda: now[0]) for r in range(3)]
    beats[1].note(stage="reduce:sum", in_collective=True, step=3)

    def tick(seconds, ranks):
        now[0] += seconds
        for r in ranks:
            beats[r].beat()

    tick(0, (1, 2, 0))
    tick(1, (1, 2, 0))  # rank 0 last sees rank 1's beat change at t=1
    beats[2].stop()  # its last beat says it exited
    for _ in range(4):
        tick(4, (0,))  # ranks 1 and 2 post nothing for 16 s
    said = beats[0].messages
    assert len(said) == 1 and "rank 1 (pid " in said[0] and "has sent no heartbeat for 12s" in said[0]
    assert "waiting in collective 'reduce:sum', step 3" in said[0] and "devices.timeout_s=600s" in said[0]
    assert "silent, last heartbeat 16s ago" in beats[0].describe(1) and "exited" in beats[0].describe(2)
    tick(1, (1, 0))
    assert len(said) == 2 and "rank 1 answers again after 17s" in said[1]
    assert beats[1].messages == []  # rank 0 kept beating while rank 1 was away


def test_a_rank_paused_while_it_reads_the_beats_names_no_one():
    """Rank 1 stops (SIGSTOP, a stalled VM) for 10 s right after its read of the store returned: what it read is
    from before the pause, so it may not be judged by the clock after it (CI: rank 0 named silent at resume)."""
    now = [0.0]

    class PausedAfterRead:  # the in-memory store, with the pause after a read
        def __init__(self) -> None:
            self.store, self.pause_s = dist.HashStore(), 0.0

        def __getattr__(self, name):
            return getattr(self.store, name)

        def clone(self):  # each monitor's own connection is this store too
            return self

        def multi_get(self, keys):
            values = self.store.multi_get(keys)
            now[0] += self.pause_s
            return values

    shared = PausedAfterRead()
    beats = [Heartbeat(2, store=shared, rank=r, world_size=2, timeout_s=30, log=lambda m: None,
                       clock=lambda: now[0]) for r in range(2)]
    for _ in range(3):
        now[0] += 0.5
        beats[0].beat()
        beats[1].beat()
    shared.pause_s = 10.0
    beats[1].beat()  # read, then paused
    shared.pause_s = 0.0
    beats[0].beat()  # rank 0 went on beating meanwhile
    beats[1].beat()
    assert beats[1].messages == [] and "alive" in beats[1].describe(0)


def test_heartbeat_s_zero_is_off_and_negative_is_refused():
    assert DevicesConfig().heartbeat_s == 60.0 and DevicesConfig(heartbeat_s=0).heartbeat_s == 0
    with pytest.raises(ValueError, match="heartbeat_s"):
        DevicesConfig(heartbeat_s=-1)
