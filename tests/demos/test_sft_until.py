"""`sft_until`: the warm start's stopping rule, checked at coarse then fine intervals."""

import torch

from verl.demos.arithmetic import sft_until


class _Steps:
    """An SFT trainer's `train_steps` that only counts."""

    def __init__(self):
        self.calls = []

    def train_steps(self, n):
        self.calls.append(n)
        return [{"loss": 1.0}] * n


def test_it_checks_every_chunk_then_every_near_steps_once_close_and_stops_at_the_target():
    accuracies = iter([0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.9])
    sft = _Steps()
    steps, acc, history = sft_until(sft, lambda: next(accuracies), 0.45, 600, 10, near=(0.1, 5))
    assert sft.calls == [10, 10, 10, 5, 5, 5]  # coarse until 10% was seen, then fine
    assert (steps, acc, len(history)) == (45, 0.5, 45)


def test_it_stops_at_max_steps_with_a_short_last_chunk():
    sft = _Steps()
    steps, acc, _ = sft_until(sft, lambda: 0.0, 0.45, 25, 10, near=(0.1, 5))
    assert sft.calls == [10, 10, 5] and (steps, acc) == (25, 0.0)


class _Model:
    """An SFT trainer whose steps move one weight by 1 (and an optimizer state with it): what a rollback restores."""

    def __init__(self):
        self.model = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(self.model.weight)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.calls = []

    def train_steps(self, n):
        self.calls.append(n)
        for _ in range(n):
            self.model.weight.grad = -torch.ones_like(self.model.weight)
            self.optimizer.step()
        return [{"loss": float(self.model.weight)}] * n


def test_a_check_over_the_ceiling_goes_back_to_the_check_before_and_takes_the_steps_again():
    accuracies = iter([0.0, 0.2, 0.9, 0.5])
    sft = _Model()
    weights = []

    def accuracy():
        weights.append(float(sft.model.weight))
        return next(accuracies)

    steps, acc, history = sft_until(sft, accuracy, 0.4, 100, 10, near=(0.1, 2), ceiling=0.55)
    assert sft.calls == [10, 10, 2, 2]  # the 0.9 check's two steps are dropped, then taken again
    assert (steps, acc, len(history)) == (22, 0.5, 22)
    assert weights[3] == weights[2]  # the same steps again, from the weights of the 0.2 check (not on from 0.9's)
    state = sft.optimizer.state[sft.model.weight]["momentum_buffer"]
    replay = _Model()  # ...with its optimizer state: as if the dropped steps had never been taken
    replay.train_steps(22)
    assert torch.equal(sft.model.weight, replay.model.weight)
    assert torch.equal(state, replay.optimizer.state[replay.model.weight]["momentum_buffer"])


def test_the_ceiling_gives_up_after_its_retries_and_keeps_the_last_check():
    sft = _Model()
    steps, acc, _ = sft_until(sft, lambda: 0.9, 0.4, 100, 10, ceiling=0.55, retries=2)
    assert sft.calls == [10, 10, 10] and (steps, acc) == (10, 0.9)
