"""`sft_until(..., overshoot=)`: a skill that appears within a few steps (the agent demo's copy of the tool result)
must not end the warm start far past its target, wherever in a chunk the float rounding of a kernel puts it."""

from __future__ import annotations

import torch

from verl.demos.arithmetic import sft_until


class _FakeSFT:
    """An SFT whose 'accuracy' is a function of how far its weight has moved (1 per step); its Adam counts the
    steps, so a restore must put the optimizer state back with the weights, as the real one's must be."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.model.weight.zero_()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.0)
        self.calls: list[int] = []

    def train_steps(self, n: int) -> list[dict[str, float]]:
        self.calls.append(n)
        for _ in range(n):
            self.optimizer.zero_grad()
            self.model.weight.sum().backward()
            self.optimizer.step()  # lr 0: only its step count moves
            with torch.no_grad():
                self.model.weight.add_(1.0)
        return [{"loss": 1.0}] * n

    @property
    def position(self) -> int:
        return int(self.model.weight.item())

    @property
    def optimizer_steps(self) -> int:
        return int(self.optimizer.state[self.model.weight]["step"])


def _accuracy_of(sft: _FakeSFT, curve: dict[int, float]):
    return lambda: max((acc for step, acc in curve.items() if step <= sft.position), default=0.0)


def test_a_chunk_that_jumps_past_the_bound_is_retaken_step_by_step():
    sft = _FakeSFT()
    curve = {21: 0.05, 23: 0.1, 24: 0.3, 26: 0.95}  # the skill appears between steps 24 and 26
    steps, acc, history = sft_until(sft, _accuracy_of(sft, curve), 0.2, 100, chunk=10, overshoot=0.5)
    assert (steps, acc, len(history)) == (24, 0.3, 24) and sft.position == 24  # the chunk to 30 was undone
    assert sft.calls == [10, 10, 10, 1, 1, 1, 1] and sft.optimizer_steps == 24  # its state came back too


def test_a_single_step_past_the_bound_stops_the_warm_start_before_it():
    sft = _FakeSFT()
    curve = {15: 0.1, 17: 0.9}
    steps, acc, _ = sft_until(sft, _accuracy_of(sft, curve), 0.2, 100, chunk=10, overshoot=0.5)
    assert (steps, acc) == (16, 0.1) and sft.position == 16  # step 17 jumped to 90%: undone, and no further
    assert sft.calls == [10, 10, 1, 1, 1, 1, 1, 1, 1] and sft.optimizer_steps == 16


def test_without_a_bound_the_chunks_run_as_before():
    sft = _FakeSFT()
    curve = {24: 0.3, 26: 0.95}
    steps, acc, _ = sft_until(sft, _accuracy_of(sft, curve), 0.2, 100, chunk=10)
    assert (steps, acc, sft.calls) == (30, 0.95, [10, 10, 10])
