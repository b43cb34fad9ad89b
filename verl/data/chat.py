"""Turning canonical rows into token ids: chat templates, prompt boundaries, assistant-only loss masks.

Only duck-typed tokenizer calls (`__call__`, `apply_chat_template`), so this module does not import
torch or transformers. Chat messages always go through the tokenizer's template; plain strings do only
when asked (`apply_chat_template="always"`), because a base model's raw-text prompt must stay raw.
"""

from __future__ import annotations

from typing import Any

from verl.errors import ConfigError, DataError, ModelError
from verl.utils.tokenizer_protocol import Tokenizer

TEMPLATE_MODES = ("auto", "always", "never")
Messages = list[dict[str, str]]


def template_mode(apply_chat_template: bool | str) -> str:
    """Accept True/False (as the trainer config says) or 'auto'/'always'/'never'."""
    if apply_chat_template is True:
        return "auto"
    if apply_chat_template is False:
        return "never"
    if apply_chat_template not in TEMPLATE_MODES:
        raise ConfigError(
            f"apply_chat_template={apply_chat_template!r}: use 'auto' (messages only), 'always' or 'never'"
        )
    return str(apply_chat_template)


def _where(row: dict[str, Any] | None) -> str:
    if row and "file" in row and "line" in row:
        return f"{row['file']}:{row['line']}: "
    return ""


def render(
    tokenizer: Tokenizer, messages: Messages, add_generation_prompt: bool, row: dict[str, Any] | None = None
) -> str:
    """The chat template applied as text (tokenised separately so offsets are available), with the row's
    `tools` (JSON schemas, the OpenAI function format) when it has them."""
    if not getattr(tokenizer, "chat_template", None):
        raise ModelError(
            f"{_where(row)}the row has chat messages but the tokenizer has no chat_template; use an instruct "
            "model's tokenizer, set tokenizer.chat_template, or give plain string prompts"
        )
    try:
        tools = (row or {}).get("tools")
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **({"tools": tools} if tools else {})
        )
    except Exception as e:  # jinja errors (e.g. templates that reject a role order) are data problems
        raise DataError(f"{_where(row)}the chat template rejected these messages: {e}") from None


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _eos(tokenizer: Tokenizer) -> int | None:
    return getattr(tokenizer, "eos_token_id", None)


def encode_prompt(
    tokenizer: Tokenizer, prompt: str | Messages, mode: str, row: dict[str, Any] | None = None
) -> list[int]:
    """Prompt ids for generation: templated with a generation prompt if messages (or mode='always')."""
    if isinstance(prompt, list) or mode == "always":
        if mode == "never" and isinstance(prompt, list):
            raise DataError(
                f"{_where(row)}the prompt is chat messages but apply_chat_template='never'; use 'auto'"
            )
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return encode(tokenizer, render(tokenizer, msgs, True, row), add_special_tokens=False)
    return encode(tokenizer, prompt, add_special_tokens=True)


def _offsets(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def encode_pair(
    tokenizer: Tokenizer,
    prompt: str | Messages,
    response: str | Messages,
    mode: str,
    row: dict[str, Any] | None = None,
) -> tuple[list[int], int, bool]:
    """(ids of prompt+response, index where the response starts, whether the boundary was a mismatch).

    The boundary is the length of the separately tokenised prompt when that is a prefix of the full ids;
    when it is not (a merge across the boundary, a template that is not prefix-stable), the boundary is
    recomputed from character offsets and the caller counts the row as a mismatch.
    """
    templated = isinstance(prompt, list) or isinstance(response, list) or mode == "always"
    if templated:
        if mode == "never":
            raise DataError(
                f"{_where(row)}the row has chat messages but apply_chat_template='never'; use 'auto'"
            )
        pm = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        rm = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        prompt_text = render(tokenizer, pm, True, row)
        full_text = render(tokenizer, pm + rm, False, row)
        special = False
    else:
        prompt_text, full_text, special = prompt, prompt + response, True
    p_ids = encode(tokenizer, prompt_text, special)
    full_ids, offsets = _offsets(tokenizer, full_text, special)
    eos = _eos(tokenizer)
    if not templated and eos is not None and (not full_ids or full_ids[-1] != eos):
        full_ids.append(eos)  # the model must learn to stop after a raw-text response
        offsets.append((len(full_text), len(full_text) + 1))  # a virtual char: EOS is response
    if full_text.startswith(prompt_text) and full_ids[: len(p_ids)] == p_ids:
        return full_ids, len(p_ids), False
    cut = _common_prefix(prompt_text, full_text)
    boundary = next((i for i, (s, e) in enumerate(offsets) if s >= cut and e > s), len(full_ids))
    return full_ids, boundary, True


def reward_text(tokenizer: Tokenizer, prompt: str | Messages, response: str | Messages,
                row: dict[str, Any] | None = None) -> str:
    """What a reward model reads: prompt + response as RL scores them (`reward.model_path`) and the reward-model
    trainer trains on them, so the two never differ. Chat messages go through the tokenizer's chat template
    (a string response as the assistant's turn); plain strings are concatenated as they are, with no special
    tokens, since an RL response is decoded text without its eos."""
    if isinstance(prompt, list) or isinstance(response, list):
        pm = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        rm = response if isinstance(response, list) else [{"role": "assistant", "content": response}]
        return render(tokenizer, pm + rm, False, row)
    return f"{prompt}{response}"


def encode_conversation(
    tokenizer: Tokenizer, messages: Messages, row: dict[str, Any] | None = None
) -> tuple[list[int], list[bool], bool]:
    """(ids, per-token 'is assistant output', mismatch) for a whole templated conversation.

    Each assistant turn's character span is found by rendering the conversation up to it (with a
    generation prompt) and through it; a turn whose rendering is not a prefix of the full text (e.g.
    templates that rewrite earlier turns) is left out of the loss and reported as a mismatch.
    """
    full_text = render(tokenizer, messages, False, row)
    ids, offsets = _offsets(tokenizer, full_text, False)
    spans: list[tuple[int, int]] = []
    mismatch = False
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render_or_empty(tokenizer, messages[:i], row)
        through = render(tokenizer, messages[: i + 1], False, row)
        if through.startswith(before) and full_text.startswith(through):
            spans.append((len(before), len(through)))
        else:
            mismatch = True
    mask = [any(s >= a and e <= b for a, b in spans) and e > s for (s, e) in offsets]
    return ids, mask, mismatch


def _render_or_empty(tokenizer: Tokenizer, messages: Messages, row: dict[str, Any] | None) -> str:
    """Text before an assistant turn; some templates refuse an empty conversation, which means ''."""
    try:
        return render(tokenizer, messages, True, row)
    except DataError:
        if messages:
            raise
        return ""


__all__ = [
    "TEMPLATE_MODES",
    "template_mode",
    "render",
    "encode",
    "encode_prompt",
    "encode_pair",
    "encode_conversation",
    "reward_text",
]
