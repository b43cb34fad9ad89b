"""`sft_until`: the warm start's stopping rule, checked at coarse then fine intervals."""

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
