"""A conversation through a tokenizer's chat template as text, with tools when there are any (shared by the
tool environments and the agent endpoint), and `HERMES_TEMPLATE`: ChatML with the Hermes tool format (as
Qwen2.5 writes it: the tools as JSON in the system turn, calls in `<tool_call>` tags, results in
`<tool_response>` tags of a user turn), for local models whose own template has no tool section (the tiny
`tools` variant, `model.chat_template: hermes`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl.utils.tokenizer_protocol import Tokenizer

# The tools as JSON lines in <tools> tags of the system turn (no instructions: a tiny model does not read them),
# calls in <tool_call> tags, results in <tool_response> tags of a user turn. No whitespace control: every
# newline is written out, none follows a block tag.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{% endif %}"
    "<tools>"
    "{% for tool in tools %}{{ '\n' + (tool | tojson) }}{% endfor %}{{ '\n' }}</tools>\n"
    "<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>{{ '\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'user' %}<|im_start|>user\n{{ message.content }}<|im_end|>{{ '\n' }}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}{% set f = call.function or call %}"
    "{% if message.content or not loop.first %}{{ '\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>{{ '\n' }}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\n' }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>{{ '\n' }}{% endif %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\n' }}{% endif %}"
)


def render_chat(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], *,
                tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool) -> str:
    kwargs = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)


def turn_end(text: str, start: int, end_tokens: Sequence[str]) -> int | None:
    """Where the model's turn that begins at `start` of a rendered conversation ends: just after the first of
    its end-of-turn tokens (`end_tokens`, the eos strings), or None when none follows."""
    ends = [at + len(token) for token in end_tokens if token and (at := text.find(token, start)) >= 0]
    return min(ends, default=None)


__all__ = ["HERMES_TEMPLATE", "render_chat", "turn_end"]
