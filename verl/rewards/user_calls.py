"""How the manager calls reward functions over a batch (batched, TRL's convention) and checks what any of them
returns."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from verl.errors import RewardError
from verl.rewards.functions import GROUND_TRUTH_NAMES, LoadedFunction, at_user_line, short_repr, thread_hint
from verl.rewards.scoring_types import _Samples


def _to_float(value: Any) -> float | None:
    """The value as a Python float, or None when it is not a single real number. A bool counts as 0/1 (`return
    answer == truth` is a reward); an int too large for a float (10**400) is +-inf, which callers refuse."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            return math.inf if value > 0 else -math.inf
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value.item())
    if getattr(value, "shape", None) == () and hasattr(value, "item"):  # numpy 0-d array
        item = value.item()
        if isinstance(item, numbers.Real):
            return float(item)
    return None


class UserCodeCalls:
    """`RewardManager`'s calls of user code over a batch, and its reading of a returned value (`self.progress` is
    the manager's)."""

    def _call_batched(self, ld: LoadedFunction, idx: list[int], b: _Samples) -> list[Any]:
        if not idx:
            return []
        return self._batch_results(ld, idx, lambda: ld.fn(
            [b.data_sources[i] for i in idx] if ld.verl_style else [b.prompts[i] for i in idx],
            [b.responses[i] for i in idx],
            [b.ground_truths[i] for i in idx],
            [b.metas[i].get("extra_info") for i in idx] if ld.verl_style else [b.metas[i] for i in idx],
            **ld.spec.kwargs,
        ))

    def _batch_results(self, ld: LoadedFunction, idx: list[int], call: Callable[[], Any]) -> list[Any]:
        """`call()`'s one result per sample of `idx`, as a list; any other outcome is a RewardError."""
        span = f"samples {idx[0]}..{idx[-1]} ({len(idx)} samples)"
        try:
            out = call()
        except Exception as e:
            raise RewardError(
                f"batched reward function '{ld.label}' ({ld.where}) raised {type(e).__name__}: {e} on the "
                f"call over {span}{at_user_line(e)}. Fix the function.{thread_hint(e)}"
            ) from e
        if isinstance(out, torch.Tensor):
            out = out.reshape(-1).tolist() if out.dim() <= 1 else out
        elif hasattr(out, "tolist") and getattr(out, "ndim", None) == 1:  # numpy array
            out = out.tolist()
        if isinstance(out, (str, bytes, Mapping)) or not isinstance(out, Sequence):
            raise RewardError(
                f"batched reward function '{ld.label}' ({ld.where}) returned a {type(out).__name__}; it must "
                f"return a list with one float (or dict with 'score') per sample, {len(idx)} here."
            )
        if len(out) != len(idx):
            raise RewardError(
                f"batched reward function '{ld.label}' ({ld.where}) returned {len(out)} results for "
                f"{len(idx)} samples ({span}); return exactly one float or dict per sample, in order."
            )
        return list(out)

    def _call_trl(self, ld: LoadedFunction, idx: list[int], b: _Samples, logged: dict[str, list[float]]) -> list[Any]:
        """A TRL reward function, `fn(prompts=..., completions=..., <column>=..., **kwargs)`: one call over the
        samples, keywords only, every dataset column as a list (the ground truth under each name it may have
        come from: ground_truth, answer, solution, ...). A completion is chat-formatted
        (`[{"role": "assistant", "content": ...}]`) where its prompt is chat messages, as in TRL.

        As TRL does, it also gets `completion_ids` (where the caller passed the responses' token ids: the
        trainer does), `trainer_state` (`self.progress`), `log_metric(name, value)` (logged as
        `reward/<fn>/<name>`, the mean of the values given this batch; into `logged`) and
        `log_extra(column, values)`, whose columns TRL shows only in its completions table, which is not
        kept here (as TRL without `log_completions`)."""
        if not idx:
            return []

        def log_metric(name: str, value: float) -> None:
            number = _to_float(value)
            if number is None or not math.isfinite(number):
                raise RewardError(f"reward function '{ld.label}' ({ld.where}) logged {name!r}={short_repr(value)} with "
                                  "log_metric; a metric must be a finite number.")
            logged.setdefault(str(name), []).append(number)

        columns: dict[str, list[Any]] = {
            "prompts": [b.prompts[i] for i in idx],
            "completions": [[{"role": "assistant", "content": b.responses[i]}] if isinstance(b.prompts[i], list)
                            else b.responses[i] for i in idx],
            "data_source": [b.data_sources[i] for i in idx],
        }
        if b.response_ids is not None:
            columns["completion_ids"] = [[int(t) for t in b.response_ids[i]] for i in idx]
        for name in GROUND_TRUTH_NAMES:
            columns[name] = [b.ground_truths[i] for i in idx]
        for key in dict.fromkeys(k for i in idx for k in b.metas[i]):
            columns.setdefault(key, [b.metas[i].get(key) for i in idx])
        columns |= {"trainer_state": self.progress, "log_metric": log_metric, "log_extra": lambda column, values: None}
        params = ld.parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            kwargs = columns
        else:
            kwargs = {k: v for k, v in columns.items() if k in params}
        kwargs = {**kwargs, **ld.spec.kwargs}
        missing = [n for n, p in params.items() if p.default is p.empty and n not in kwargs
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if missing:
            raise RewardError(
                f"reward function '{ld.label}' ({ld.where}) is a TRL-style function (it takes `completions`) and "
                f"needs {missing}, which the rows do not have; columns here: {sorted(columns)}. Fix: name the "
                "parameters after the dataset's columns, give them defaults, or take **kwargs.")
        return self._batch_results(ld, idx, lambda: ld.fn(**kwargs))

    def _parse(
        self, ld: LoadedFunction, i: int, value: Any, data_source: str | None
    ) -> tuple[float, dict[str, float], dict[str, Any]]:
        """(score, numeric extras for the metrics, the other extras for the sample's record)."""
        at = f"reward function '{ld.label}' ({ld.where}) on sample {i} (data_source={data_source!r})"
        extras: dict[str, float] = {}
        other: dict[str, Any] = {}
        if isinstance(value, Mapping):
            if "score" not in value:
                raise RewardError(
                    f"{at} returned a dict without a 'score' key (keys: {sorted(map(str, value))}); "
                    "return {'score': float, ...extras}."
                )
            for k, v in value.items():
                if k == "score":
                    continue
                f = _to_float(v)
                if f is None or not math.isfinite(f):  # text, None, lists, NaN: kept with the sample
                    other[str(k)] = v
                else:
                    extras[str(k)] = f
            value = value["score"]
        score = _to_float(value)
        if score is None:
            raise RewardError(
                f"{at} returned {short_repr(value)} ({type(value).__name__}); a reward must be a "
                "finite number or a dict with a numeric 'score'. Make every code path return "
                "one (a missing return gives None)."
            )
        if not math.isfinite(score):
            raise RewardError(
                f"{at} returned {short_repr(value)}; a reward must be finite "
                f"({'an integer larger than a float holds' if isinstance(value, int) else 'not NaN/inf'}"
                "). Guard the division, log or power that yields it, or clip the score."
            )
        return score, extras, other
