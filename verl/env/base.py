"""What a training environment is: a prompt source plus a reward, with a resumable prompt order.

The trainer only talks to the `Environment` protocol, so a user can plug in any object with these five
methods. `PromptEnv` implements the shared part (epoch-wise shuffling, state for resume, reward scoring
from canonical rows) for the built-in environments.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from verl.data.index import is_lazy, row_facts, rows_at
from verl.data.mixture import MIXTURE_KEY
from verl.data.report import location
from verl.data.sampler import order_for
from verl.errors import ConfigError, DataError, RewardError
from verl.rewards.manager import RewardManager, RewardResult, Scoring


@runtime_checkable
class Environment(Protocol):
    """Prompt rows in, rewards out. Rows are dicts {"prompt", "ground_truth", "data_source", "metadata"}."""

    def get_batch(self, batch_size: int) -> list[dict[str, Any]]:
        """The next `batch_size` training rows; the order continues across epochs and resumes."""
        ...

    def compute_reward(self, rows: Sequence[Mapping[str, Any]], responses: Sequence[str]) -> RewardResult:
        """Score response i against rows[i] (repeat a row for each of its n responses).

        An environment whose `compute_reward` also takes a `response_ids` keyword gets each response's
        token ids (a list of ints per response) from the trainer."""
        ...

    def val_rows(self) -> list[dict[str, Any]]:
        """Every validation row, in a fixed order."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Enough to continue the prompt order exactly after a restart."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        ...


def check_ground_truths(reward_manager: RewardManager, rows: Sequence[Mapping[str, Any]], split: str) -> None:
    """Raise DataError naming file:line of every row (the first few) that has no ground truth although a
    reward function that applies to it declares `needs_ground_truth`, or, when other rows of the split have
    one, names a ground truth in its signature (it would score the row against None): found at start-up,
    not at step N."""
    missing: list[str] = []
    count = 0
    needed: set[str] = set()
    needs: dict[str | None, list[str]] = {}  # per data_source (a few), not per row (maybe millions)
    some_have_one = any(facts.has_ground_truth for facts in row_facts(rows))
    for i, facts in enumerate(row_facts(rows)):
        if facts.has_ground_truth:
            continue
        names = needs.get(facts.data_source)
        if names is None:
            names = needs[facts.data_source] = (reward_manager.needing_ground_truth(facts.data_source) or (
                reward_manager.reading_ground_truth(facts.data_source) if some_have_one else []))
        if names:
            needed.update(names)
            count += 1
            if len(missing) < 5:
                file, line = facts.file, facts.line
                missing.append(location(file, line) if file is not None and line is not None else f"{split} row {i}")
    if not missing:
        return
    shown = ", ".join(missing) + (f" and {count - 5} more" if count > 5 else "")
    raise DataError(
        f"{split} data: {count} row(s) have no ground truth, but reward function(s) "
        f"{', '.join(sorted(needed))} need one to score them: {shown}. Fix: add the answer to those rows "
        "(field 'ground_truth', or map your field with data.fields.ground_truth=KEY), drop the rows, or use "
        "a reward function that needs no ground truth.")


def _copy_row(row: Mapping[str, Any]) -> dict[str, Any]:
    # Deep copy so a trainer that annotates rows (or a chat prompt's message dicts) cannot change the dataset.
    return copy.deepcopy(dict(row))


class PromptEnv:
    """An environment over fixed train/val rows, shuffled by a seeded permutation per epoch.

    The order depends only on (seed, epoch), never on global RNG state, so it is identical across runs
    and across a resume from `state_dict()`. A batch that crosses the end of an epoch continues into the
    next epoch's permutation, so every batch is full. Rows may be read on demand (`verl.data.index`: only
    the batch drawn is read) and may be a mixture of sources (`verl.data.mixture`: drawn with its weights).
    """

    def __init__(
        self,
        train_rows: Sequence[Mapping[str, Any]],
        reward_manager: RewardManager | None,
        *,
        val_rows: Sequence[Mapping[str, Any]] = (),
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        self._train = train_rows if is_lazy(train_rows) else list(train_rows)
        self._val = val_rows if is_lazy(val_rows) else list(val_rows)
        # Fail at start-up, not at step 500, when some row's data_source has no reward function. (None: the
        # environment scores episodes itself, as a multi-turn environment does in `step`.)
        for split, rows in (("train", self._train), ("val", self._val)) if reward_manager is not None else ():
            try:
                reward_manager.check_data_sources(f.data_source for f in row_facts(rows))
            except RewardError as e:
                raise RewardError(f"{split} data: {e}") from None
            check_ground_truths(reward_manager, rows, split)
        self.reward_manager = reward_manager
        self.seed = seed
        self.shuffle = shuffle
        # Stream (0,) keeps this order apart from other consumers of the same seed.
        self._order = order_for(self._train, seed, shuffle, stream=(0,), what="environment")
        mixture = getattr(self._train, "mixture", None)
        if mixture is not None:
            self.metric_sources: tuple[str, list[str]] | None = (MIXTURE_KEY, list(mixture.names))
        else:
            found = {f.data_source for f in row_facts(self._train)}
            self.metric_sources = ("data_source", sorted(found, key=str)) if len(found) > 1 else None

    def __len__(self) -> int:
        return len(self._train)

    @property
    def epoch(self) -> int:
        """Epochs completed so far (a batch that wraps around counts toward the next one)."""
        return self._order.epoch

    def get_batch(self, batch_size: int) -> list[dict[str, Any]]:
        """The next `batch_size` training rows (copies)."""
        n = len(self._train)
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(
                f"batch_size must be a positive int, got {batch_size!r} (data.train_batch_size)."
            )
        if batch_size > n:
            raise ConfigError(
                f"data.train_batch_size={batch_size} is larger than the {n} training prompts, "
                "so a batch would repeat prompts; lower data.train_batch_size or add data."
            )
        rows = rows_at(self._train, self._order.take(batch_size))
        return rows if is_lazy(self._train) else [_copy_row(r) for r in rows]  # lazy rows are fresh dicts

    def val_rows(self) -> list[dict[str, Any]]:
        return list(self._val) if is_lazy(self._val) else [_copy_row(r) for r in self._val]

    def compute_reward(self, rows: Sequence[Mapping[str, Any]], responses: Sequence[str], *,
                       response_ids: Sequence[Sequence[int]] | None = None) -> RewardResult:
        if self.reward_manager is None:
            raise ConfigError(f"{type(self).__name__} was built without a reward manager, so it cannot score "
                              "single responses; pass a RewardManager, or score whole episodes in step() "
                              "(verl.env.multiturn.MultiTurnEnv).")
        return self.reward_manager.score(
            [r.get("prompt") for r in rows],
            list(responses),
            [r.get("ground_truth") for r in rows],
            [r.get("metadata") or {} for r in rows],
            [r.get("data_source") for r in rows],
            response_ids,
        )

    def start_scoring(self, rows: Sequence[Mapping[str, Any]]) -> Scoring | None:
        """What `compute_reward(rows, responses)` computes, started before the responses exist: `add` them as
        they are written, `finish` with all of them. None where that would not be the same: no reward
        manager, or a subclass that scores in its own `compute_reward`."""
        if self.reward_manager is None or type(self).compute_reward is not PromptEnv.compute_reward:
            return None
        return self.reward_manager.start([r.get("prompt") for r in rows], [r.get("ground_truth") for r in rows],
                                         [r.get("metadata") or {} for r in rows], [r.get("data_source") for r in rows])

    def state_dict(self) -> dict[str, Any]:
        return self._order.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._order.load_state_dict(state)


__all__ = ["Environment", "PromptEnv"]
