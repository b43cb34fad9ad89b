"""A conversation through a tokenizer's chat template as text, with tools when there are any (shared by the
tool environments and the agent endpoint)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None,
                add_generation_prompt: bool) -> str:
    kwargs = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


__all__ = ["render_chat"]
