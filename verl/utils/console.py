"""Consoles that print text as it is: no rich markup, no highlighting, no hard wrapping.

Exception messages, file names, rows and model output routinely contain square brackets (`[/INST]`,
`runs/[exp]`, `logging.backends=[wandb]`); rich would read them as markup, drop them, or raise
`MarkupError` and lose the real message. Every console verl prints user text on comes from here, and
styling is applied to `Text` spans, never by embedding markup in a string.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text


def plain_console(*, stderr: bool = False, **kwargs: Any) -> Console:
    """A console for which `print(str)` shows the string verbatim (markup off, no highlighting) and long
    lines are not broken, so a message can be copied or grepped from a log."""
    kwargs.setdefault("soft_wrap", True)
    return Console(stderr=stderr, markup=False, highlight=False, **kwargs)


def labelled(label: str, text: str, style: str) -> Text:
    """`label` in `style`, then `text` verbatim: e.g. a red "error (ConfigError): " before a message."""
    out = Text(label, style=style)
    out.append(text)
    return out


__all__ = ["labelled", "plain_console"]
