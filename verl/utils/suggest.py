"""One "did you mean" for every unknown name (config keys, engines, rewards, envs, dtypes, ...).

Every error about a misspelt name ends with the same hint, built the same way, so users see one style and
the closeness rule is tuned in one place.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(word: str, choices: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The choice most like `word` (difflib's ratio at least `cutoff`), or None."""
    matches = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=cutoff)
    return matches[0] if matches else None


def did_you_mean(word: str, choices: Iterable[str], *, cutoff: float = 0.6, prefix: str = "") -> str:
    """` Did you mean 'PREFIXmatch'?` (with its leading space, to append to a sentence), or "" with none.
    `prefix` puts the match back in its context, e.g. the section of a dotted config key."""
    match = closest(word, choices, cutoff=cutoff)
    return f" Did you mean '{prefix}{match}'?" if match is not None else ""


__all__ = ["closest", "did_you_mean"]
