"""Score a batch of responses with the configured reward functions.

The manager loads every function once, when training starts, so a typo in a path fails before the first
rollout. At scoring time it is strict on purpose: a function that raises, returns None/NaN/inf or a
non-number, or a sample that no function applies to, stops the run with a message naming the function,
the sample index and the fix, because a silently-zero reward wastes a whole training run.

Besides our own calling convention (`fn(prompt, response, ground_truth, **metadata)`, or lists with
`batched`), two others are recognised by their parameter names, so functions written for them work
unchanged: volcengine/verl's `compute_score(data_source, solution_str, ground_truth, extra_info)` and TRL's
`fn(completions, **kwargs)` (where None means "does not apply to this sample").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from verl.errors import ConfigError, RewardError
from verl.rewards.functions import (
    ACCURACY_KEY,
    GROUND_TRUTH_NAMES,
    LoadedFunction,
    call_one,
    load_function,
    takes_parameter,
)
from verl.rewards.pool import RewardCall, RewardPool
from verl.rewards.processes import ProcessRewardPool, recipe
from verl.rewards.scoring_types import RewardResult, TrainingProgress, _Samples
from verl.rewards.spec import RewardFunctionSpec
from verl.rewards.user_calls import UserCodeCalls


class RewardManager(UserCodeCalls):
    """Loads reward functions up front and scores batches with their weighted sum."""

    def __init__(
        self,
        specs: Sequence[RewardFunctionSpec | Mapping[str, Any] | Callable[..., Any]],
        *,
        base_dir: str | Path | None = None,
        workers: int = 4,
        timeout_s: float = 60.0,
        key: str = "reward.functions",
        required: bool = True,
    ) -> None:
        """`workers` and `timeout_s` are the pool's (`reward.workers`, `reward.timeout_s`; see `configure`);
        `key` is the config key the specs came from, for the messages (`reward.val_functions`). `required=False`:
        no specs is allowed (an agent that returns its own rewards); scoring anything then raises."""
        self.pool = RewardPool(workers, timeout_s)
        self.sample_pool: ProcessRewardPool | None = None  # reward.executor=process: per-sample calls run there
        self.base_dir = None if base_dir is None else str(base_dir)
        if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Sequence):
            raise ConfigError(
                f"{key} must be a list of specs, got {type(specs).__name__}; "
                f"write e.g. {key}: [{{name: numeric_match}}]."
            )
        if not specs and required:
            raise ConfigError(
                f"{key} is empty, so every sample would score 0; add at least one "
                f"function, e.g. {key}: [{{name: numeric_match}}]."
            )
        self.progress = TrainingProgress()  # set by the trainer before each batch is scored
        self.max_worker_crashes = 8  # reward.max_worker_crashes and reward.max_rss_mb (see `configure`)
        self.max_rss_mb: float = 4096
        used: dict[str, int] = {}  # the labels given so far
        self._loaded = [load_function(raw, i, key, base_dir, used) for i, raw in enumerate(specs)]

    @property
    def names(self) -> list[str]:
        """The labels used as keys of `RewardResult.per_function` and in metric names."""
        return [ld.label for ld in self._loaded]

    @property
    def described(self) -> list[str]:
        """The labels, each with the calling convention it was recognised by when it is not ours."""
        return [ld.label + (" (TRL's convention)" if ld.trl_style else " (volcengine/verl's convention)"
                            if ld.verl_style else "") for ld in self._loaded]

    @property
    def known_data_sources(self) -> list[str] | None:
        """Every data_source some function lists; None when a function applies to every sample, or there is
        none (an agent's own rewards: scoring then says so)."""
        if not self._loaded or any(ld.spec.data_sources is None for ld in self._loaded):
            return None
        return sorted({s for ld in self._loaded for s in ld.spec.data_sources or ()})

    def needing_ground_truth(self, data_source: str | None) -> list[str]:
        """Labels of the functions that score samples of `data_source` and declare `needs_ground_truth`."""
        return [ld.label for ld in self._loaded
                if ld.applies(data_source) and getattr(ld.fn, "needs_ground_truth", False)]

    def reading_ground_truth(self, data_source: str | None) -> list[str]:
        """Labels of the functions that score samples of `data_source` and whose signature names a ground truth
        (our third parameter, volcengine/verl's `ground_truth`, a TRL function's `ground_truth` column). verl's
        own functions are not guessed from their signature: they declare `needs_ground_truth`."""
        return [ld.label for ld in self._loaded if ld.applies(data_source)
                and not getattr(ld.fn, "__module__", "").startswith("verl.") and (
            (len(ld.positional) > 2 and not ld.trl_style and ld.positional[2] in GROUND_TRUTH_NAMES)
            or takes_parameter(ld.fn, "ground_truth"))]

    def extracted_answers(self, responses: Sequence[str],
                          data_sources: Sequence[str | None] | None = None) -> list[Any]:
        """Per response, what the first function that applies to it and has an `extract_answer(response,
        **kwargs)` attribute (numeric_match, exact_match, or a user function that sets one) reads as its answer
        (None where no function does): what maj@k votes on instead of the whole text."""
        data_sources = [None] * len(responses) if data_sources is None else data_sources
        out: list[Any] = []
        for response, data_source in zip(responses, data_sources, strict=True):
            ld = next((ld for ld in self._loaded if ld.applies(data_source)
                       and callable(getattr(ld.fn, "extract_answer", None))), None)
            if ld is None:
                out.append(None)
                continue
            try:
                out.append(ld.fn.extract_answer(response, **ld.spec.kwargs))
            except Exception as exc:
                raise RewardError(f"{ld.where}: its extract_answer raised {type(exc).__name__}: {exc}; fix the "
                                  "function, or remove its extract_answer attribute to vote on the text") from exc
        return out

    def check_data_sources(self, data_sources: Iterable[str | None]) -> None:
        """Raise RewardError when some sample has no function to score it (instead of scoring it 0)."""
        known = self.known_data_sources
        if known is None:
            return
        unknown: dict[str | None, list[int]] = {}
        for i, ds in enumerate(data_sources):
            if ds is None or ds not in known:
                unknown.setdefault(ds, []).append(i)
        if not unknown:
            return
        parts = []
        for ds, idx in unknown.items():
            shown = ", ".join(str(i) for i in idx[:5]) + (f" and {len(idx) - 5} more" if len(idx) > 5 else "")
            parts.append(f"{'no data_source' if ds is None else f'data_source {ds!r}'} (sample {shown})")
        raise RewardError(
            "no reward function applies to " + "; ".join(parts) + ". Every entry of reward.functions lists "
            f"data_sources, and the known data_sources are {known}. Fix: correct the rows' data_source, add it "
            "to a function's data_sources, or add a function without data_sources (it applies to every "
            "sample). A sample is never scored 0 silently."
        )

    def score(
        self,
        prompts: Sequence[Any],
        responses: Sequence[str],
        ground_truths: Sequence[Any],
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        data_sources: Sequence[str | None] | None = None,
        response_ids: Sequence[Sequence[int]] | None = None,
    ) -> RewardResult:
        """Score N samples; every list has one entry per sample (metadata/data_sources may be None).

        `response_ids` (each response's token ids, up to and including its eos) reach TRL-style functions
        as `completion_ids`. The calls run on the pool (`start`, then `Scoring.finish`): the one path,
        whether the responses come all at once, as here, or one by one as they finish generating."""
        n = len(responses)
        lengths = {
            "prompts": len(prompts),
            "responses": n,
            "ground_truths": len(ground_truths),
            "metadata": n if metadata is None else len(metadata),
            "data_sources": n if data_sources is None else len(data_sources),
        } | ({} if response_ids is None else {"response_ids": len(response_ids)})
        if len(set(lengths.values())) != 1:
            raise RewardError(
                f"RewardManager.score got lists of different lengths {lengths}; pass one entry "
                "per sample in each (repeat the prompt's fields for every response)."
            )
        return self.start(prompts, ground_truths, metadata, data_sources).finish(responses, response_ids)

    def start(
        self,
        prompts: Sequence[Any],
        ground_truths: Sequence[Any],
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        data_sources: Sequence[str | None] | None = None,
    ) -> Scoring:
        """The scoring of N samples whose responses are still to come: hand them to `Scoring.add` as they
        are written (their per-sample calls start at once) and all of them to `Scoring.finish`."""
        n = len(prompts)
        metadata = [None] * n if metadata is None else metadata
        data_sources = [None] * n if data_sources is None else data_sources
        lengths = {"prompts": n, "ground_truths": len(ground_truths), "metadata": len(metadata),
                   "data_sources": len(data_sources)}
        if len(set(lengths.values())) != 1:
            raise RewardError(
                f"RewardManager.start got lists of different lengths {lengths}; pass one entry "
                "per sample in each (repeat the prompt's fields for every response)."
            )
        if not self._loaded:
            raise RewardError("there is no reward function to score these replies: reward.functions is empty, "
                              "which an agent may leave so only when it returns every episode's reward (env.agent; "
                              "this one returned None). Fix: return a number from the agent, or set reward.functions")
        self.check_data_sources(data_sources)
        metas = [dict(m) if m is not None else {} for m in metadata]
        return Scoring(self, list(prompts), list(ground_truths), metas, list(data_sources))

    def configure(self, *, workers: int | None = None, timeout_s: float | None = None,
                  executor: str | None = None, max_worker_crashes: int | None = None,
                  max_rss_mb: float | None = None) -> None:
        """Set `reward.workers` / `reward.timeout_s` / `reward.executor` / `reward.max_worker_crashes` /
        `reward.max_rss_mb` (the trainer passes the run's config here; None keeps the current value, and
        max_rss_mb 0 is no limit). With executor "process" the per-sample functions run in worker processes
        (verl.rewards.processes), the batched and TRL-style ones on the threads; a function a worker cannot
        get is refused now."""
        if executor not in (None, "thread", "process"):
            raise ConfigError(f"reward.executor must be 'thread' or 'process', got {executor!r}.")
        pool = RewardPool(self.pool.workers if workers is None else workers,
                          self.pool.timeout_s if timeout_s is None else timeout_s)
        self.pool = pool  # a scoring already started finishes on the pools it started on
        if max_worker_crashes is not None:
            if (isinstance(max_worker_crashes, bool) or not isinstance(max_worker_crashes, int)
                    or max_worker_crashes < 0):
                raise ConfigError(f"reward.max_worker_crashes must be an integer >= 0 (worker processes that may die "
                                  f"in one step before the run stops), got {max_worker_crashes!r}.")
            self.max_worker_crashes = max_worker_crashes
        if max_rss_mb is not None:
            if isinstance(max_rss_mb, bool) or not isinstance(max_rss_mb, (int, float)) or not max_rss_mb >= 0:
                raise ConfigError(f"reward.max_rss_mb must be a number of MiB >= 0 (0: no limit), got {max_rss_mb!r}.")
            self.max_rss_mb = max_rss_mb
        processes = self.sample_pool is not None if executor is None else executor == "process"
        recipes = [recipe(ld, self.base_dir) if processes and not (ld.trl_style or ld.spec.batched) else None
                   for ld in self._loaded]
        self.sample_pool = (ProcessRewardPool(recipes, pool.workers, pool.timeout_s, self.max_rss_mb)
                            if any(r is not None for r in recipes) else None)
        if self.sample_pool is not None:
            self.sample_pool.start()

    def _assemble(self, batch: _Samples, calls: list[list[RewardCall] | RewardCall | None],
                  logged: list[dict[str, list[float]]], pool: RewardPool,
                  sample_pool: ProcessRewardPool | None = None) -> RewardResult:
        """The result of the finished calls (one list per function, per sample, or one batch call), put
        together in a fixed order, whichever call finished first: the first error in (function, sample)
        order is the one raised, as when the calls ran one after another. A sample whose worker process died
        scores 0 with the reason, up to `max_worker_crashes` in the batch (one step's scoring); the next one
        stops the run (the rest of the batch is not waited for)."""
        n = len(batch.responses)
        data_sources = batch.data_sources
        timeout_s = pool.timeout_s
        total = torch.zeros(n, dtype=torch.float64)
        per_function: dict[str, torch.Tensor] = {}
        applied: dict[str, torch.Tensor] = {}
        metrics: dict[str, float] = {}
        sample_extras: list[dict[str, dict[str, Any]]] = [{} for _ in range(n)]
        accuracy: list[float | None] = [None] * n  # the `acc` extras (weighted sum), for dynamic sampling
        timeouts = crashes = replacements = 0

        def late(c: RewardCall, on: RewardPool | ProcessRewardPool = pool) -> bool:  # waits for the call: True
            if on.wait(c).error is not None:  # when it timed out; raises what it raised
                raise c.error
            return c.timed_out

        for ld, call, extras in zip(self._loaded, calls, logged, strict=True):
            idx = [i for i in range(n) if ld.applies(data_sources[i])]
            raw_list, mask_list = [0.0] * n, [False] * n  # filled as Python lists: one tensor each, not n writes
            timed_out: list[int] = []
            crashed: dict[int, str] = {}  # sample -> why its worker process died
            if isinstance(call, list):  # one call per sample
                results = []
                for i, c in zip(idx, call, strict=True):
                    if late(c, sample_pool or pool):
                        timed_out.append(i)
                    elif c.crashed is not None:
                        crashed[i] = c.crashed
                        crashes += 1
                        if crashes > self.max_worker_crashes:
                            raise self._too_many_crashes(crashes, ld, i, c.crashed)
                    replacements += c.replaced
                    results.append(c.value)
            elif call is not None and late(call):  # one call over the batch
                timed_out, results, extras = idx, [None] * len(idx), {}  # what it logged so far is dropped
            else:
                results = [] if call is None else call.value
            given_up = set(timed_out)
            for i, value in zip(idx, results, strict=True):
                if i in given_up:  # scored 0, with the reason next to the sample
                    mask_list[i] = True
                    sample_extras[i][ld.label] = {"status": "timeout", "reason": (
                        f"reward function '{ld.label}' took longer than reward.timeout_s={timeout_s:g} s "
                        "and was given up (scored 0)")}
                    continue
                if i in crashed:
                    mask_list[i] = True
                    sample_extras[i][ld.label] = {"status": "worker_crashed", "reason": (
                        f"reward function '{ld.label}': {crashed[i]} (scored 0)")}
                    continue
                if value is None and ld.trl_style:  # TRL's "does not apply to this sample"
                    continue
                s, extra, other = self._parse(ld, i, value, data_sources[i])
                raw_list[i] = s
                mask_list[i] = True
                for k, v in extra.items():
                    extras.setdefault(k, []).append(v)
                if ACCURACY_KEY in extra:
                    accuracy[i] = (accuracy[i] or 0.0) + ld.spec.weight * extra[ACCURACY_KEY]
                if other:
                    sample_extras[i][ld.label] = other
            raw = torch.tensor(raw_list, dtype=torch.float64)
            mask = torch.tensor(mask_list, dtype=torch.bool)
            total += ld.spec.weight * raw
            per_function[ld.label] = raw.float()
            applied[ld.label] = mask
            if mask.any():
                metrics[f"reward/{ld.label}/score"] = float(raw[mask].mean())
            for k, vals in extras.items():
                metrics[f"reward/{ld.label}/{k}"] = math.fsum(vals) / len(vals)
            if timed_out:
                metrics[f"reward/{ld.label}/timeouts"] = float(len(timed_out))
                timeouts += len(timed_out)
        if applied:
            unscored = ~torch.stack(list(applied.values())).any(0)
            if bool(unscored.any()):
                i = int(unscored.nonzero()[0])
                raise RewardError(
                    f"no reward function scored sample {i} (data_source={data_sources[i]!r}): each one that "
                    f"applies returned None ({', '.join(ld.label for ld in self._loaded if ld.trl_style)}), and "
                    f"{int(unscored.sum())} sample(s) of this batch are like it. Return a score for every sample "
                    "some function applies to (None only where another function scores it); a sample is never "
                    "scored 0 silently.")
        if n:
            metrics["reward/mean"] = float(total.mean())
        metrics["reward/timeouts"] = float(timeouts)
        # Logged on threads too (always 0 there: a crash on a thread takes the trainer with it), so a run's
        # metrics have the same keys whichever reward.executor it uses.
        metrics["reward/worker_crashes"] = float(crashes)
        metrics["reward/worker_replacements"] = float(replacements)
        acc = (None if all(a is None for a in accuracy)
               else torch.tensor([math.nan if a is None else a for a in accuracy], dtype=torch.float32))
        return RewardResult(total.float(), metrics, per_function, applied, sample_extras, acc)

    def _too_many_crashes(self, crashes: int, ld: LoadedFunction, i: int, reason: str) -> RewardError:
        """The error past reward.max_worker_crashes: a function that crashes this often would otherwise train
        the policy on zeros, so the run stops, naming the last crash and the setting."""
        return RewardError(
            f"reward worker processes died in {crashes} calls while scoring this step's samples, more than "
            f"reward.max_worker_crashes={self.max_worker_crashes}; the last: reward function '{ld.label}' "
            f"({ld.where}) on sample {i}: {reason}. Each crash (os._exit, a signal, a crash in C code, the OOM "
            "killer) scores its sample 0, but this many means the function is broken: fix it (run it with "
            "reward.executor=thread to see where it fails; a SIGKILL is often the OOM killer, see dmesg), or "
            "raise reward.max_worker_crashes.")

    def __repr__(self) -> str:
        parts = [
            f"{ld.label}(w={ld.spec.weight:g}"
            + (f", data_sources={ld.spec.data_sources}" if ld.spec.data_sources else "")
            + ")"
            for ld in self._loaded
        ]
        return f"RewardManager({', '.join(parts)})"


class Scoring:
    """One batch's scoring in flight (`RewardManager.start`): each response's per-sample calls go to the pool
    when it is `add`ed; `finish` adds the rest, submits the calls over the whole batch (batched and
    TRL-style functions), waits for everything and puts the result together in a fixed order, so the
    scores and metrics do not depend on which call finished first."""

    def __init__(self, manager: RewardManager, prompts: list[Any], ground_truths: list[Any],
                 metas: list[dict[str, Any]], data_sources: list[str | None]) -> None:
        self.manager, self.pool, self.sample_pool = manager, manager.pool, manager.sample_pool
        self.prompts, self.ground_truths, self.metas, self.data_sources = prompts, ground_truths, metas, data_sources
        self._responses: list[str | None] = [None] * len(prompts)
        self._calls: dict[tuple[int, int], RewardCall] = {}  # (function, sample) -> its per-sample call

    def __len__(self) -> int:
        return len(self.prompts)

    def add(self, indices: Sequence[int], responses: Sequence[str]) -> None:
        """Samples `indices` have these responses: start their per-sample calls."""
        fns, keys = [], []
        for i, response in zip(indices, responses, strict=True):
            i = int(i)
            self._responses[i] = response
            for f, ld in enumerate(self.manager._loaded):
                if ld.trl_style or ld.spec.batched or not ld.applies(self.data_sources[i]):
                    continue
                keys.append((f, i))
                fns.append((f, (i, self.prompts[i], response, self.ground_truths[i], self.metas[i],
                                self.data_sources[i])))
        calls = (self.sample_pool.submit(fns) if self.sample_pool is not None else
                 self.pool.submit([functools.partial(call_one, self.manager._loaded[f], *args) for f, args in fns]))
        self._calls.update(zip(keys, calls, strict=True))

    def finish(self, responses: Sequence[str], response_ids: Sequence[Sequence[int]] | None = None) -> RewardResult:
        """Every sample's response (those `add`ed before must be the same; one that is not is scored again):
        the batch's result, once every call has finished or timed out."""
        n = len(self.prompts)
        if len(responses) != n or (response_ids is not None and len(response_ids) != n):
            got = {"responses": len(responses)} | ({} if response_ids is None else {"response_ids": len(response_ids)})
            raise RewardError(f"Scoring.finish got {got} for the {n} samples it was started with; pass one "
                              "response per sample, in the order of the rows.")
        batch = _Samples(self.prompts, list(responses), self.ground_truths, self.metas, self.data_sources,
                         response_ids)
        manager, loaded = self.manager, self.manager._loaded
        calls: list[list[RewardCall] | RewardCall | None] = [None] * len(loaded)
        logged: list[dict[str, list[float]]] = [{} for _ in loaded]
        applies = [[i for i in range(n) if ld.applies(self.data_sources[i])] for ld in loaded]
        whole = {f: (functools.partial(manager._call_trl, ld, idx, batch, logged[f]) if ld.trl_style
                     else functools.partial(manager._call_batched, ld, idx, batch))
                 for f, (ld, idx) in enumerate(zip(loaded, applies, strict=True))
                 if (ld.trl_style or ld.spec.batched) and idx}  # one call over the batch: queued first, the longest
        for f, call in zip(whole, self.pool.submit(list(whole.values())), strict=True):
            calls[f] = call
        todo = [i for i in range(n) if self._responses[i] != responses[i]]
        self.add(todo, [responses[i] for i in todo])
        for f, (ld, idx) in enumerate(zip(loaded, applies, strict=True)):
            if not (ld.trl_style or ld.spec.batched):
                calls[f] = [self._calls[f, i] for i in idx]
        return manager._assemble(batch, calls, logged, self.pool, self.sample_pool)


def configure_rewards(env: object, *, workers: int, timeout_s: float, executor: str = "thread",
                      max_worker_crashes: int | None = None, max_rss_mb: float | None = None) -> None:
    """Give `env`'s reward manager the run's `reward.workers`, `reward.timeout_s`, `reward.executor`,
    `reward.max_worker_crashes` and `reward.max_rss_mb` (environments without one score their own way)."""
    manager = getattr(env, "reward_manager", None)
    if isinstance(manager, RewardManager):
        manager.configure(workers=workers, timeout_s=timeout_s, executor=executor,
                          max_worker_crashes=max_worker_crashes, max_rss_mb=max_rss_mb)


def report_progress(env: object, progress: TrainingProgress) -> None:
    """Tell `env`'s reward functions how far training is, for those that shape rewards by it (TRL's
    `trainer_state`); environments without a reward manager have nothing to tell."""
    manager = getattr(env, "reward_manager", None)
    if manager is not None:
        manager.progress = progress

__all__ = ["configure_rewards", "report_progress", "RewardManager", "RewardResult", "Scoring", "TrainingProgress"]
