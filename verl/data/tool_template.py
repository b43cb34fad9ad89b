"""Tool use through the model's own chat template: the tools in the prompt, and the tool turn after a call.

An episode is token-in-token-out: the model's tokens are kept as sampled, never decoded and re-encoded, and a
tool's result is appended as the tokens of the template's tool turn. :class:`ToolTurns` finds that turn's text
once, from the template itself: it renders a probe conversation up to an assistant message, and the same with
tool messages after it and the generation prompt; what the second adds after the assistant's end-of-turn
token (the model's eos, where its turn stopped) is the tool turn, up to and including the next assistant
header. Nothing in an episode is rendered again, so a template that rewrites earlier turns when a new one
arrives (thinking templates drop earlier `<think>` blocks) changes nothing here: :func:`prefix_preserving`
reports it, a warning for whoever renders whole conversations (SFT data, the agent endpoint).

`model.chat_template: hermes` is `verl.utils.chat_render.HERMES_TEMPLATE`, ChatML with the Hermes tool format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from verl.errors import ConfigError
from verl.utils.chat_render import HERMES_TEMPLATE, render_chat, turn_end
from verl.utils.tokenizer_protocol import Tokenizer

BUILTIN_TEMPLATES = {"hermes": HERMES_TEMPLATE}


def chat_template_text(setting: str, base_dir: str | None) -> str:
    """`model.chat_template`: a built-in template's name or a .jinja file's text."""
    from verl.utils.user_code import resolve_user_path

    if setting in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[setting]

    def fail(message: str) -> ConfigError:
        return ConfigError(f"model.chat_template={setting!r}: {message} (or use a built-in template: "
                           f"{', '.join(BUILTIN_TEMPLATES)})")

    return resolve_user_path(setting, base_dir, what="chat template file", fail=fail).read_text(encoding="utf-8")


_PROBE_USER = "What is 2+3?"
_PROBE_ANSWER = "Let me check."


def _end_of_turn(tokenizer: Tokenizer) -> list[str]:
    """The strings of the tokens that end a model turn (the generation eos ids, else the tokenizer's eos)."""
    ids = getattr(getattr(tokenizer, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    ids = ids if isinstance(ids, list) else [ids]
    return [tokenizer.convert_ids_to_tokens(i) for i in ids if i is not None]


class ToolTurns:
    """The text a tool turn appends after a model turn that ended at its end-of-turn token (see the module)."""

    def __init__(self, tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]],
                 where: str = "the chat template") -> None:
        self.tokenizer, self.tools = tokenizer, list(tools)
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(f"{where}: the tokenizer has no chat template, so tool calls cannot go through it. Fix: "
                              "use an instruct model, or set tokenizer.chat_template (e.g. "
                              "verl.data.tool_template.HERMES_TEMPLATE for a ChatML model)")
        names = [t["function"]["name"] for t in self.tools]
        system = render_chat(tokenizer, [{"role": "user", "content": _PROBE_USER}], tools=self.tools,
                             add_generation_prompt=True)
        missing = [n for n in names if n not in system]
        if missing:
            raise ConfigError(f"{where}: the chat template has no tool section: the tools {missing} do not appear in "
                              "the prompt it renders with tools=[...], so the model would never learn they exist. Fix: "
                              "use the model's tool-calling template "
                              "(its tokenizer_config.json / chat_template.jinja), "
                              "or set tokenizer.chat_template to one with tools (verl.data.tool_template."
                              "HERMES_TEMPLATE is one for ChatML models)")
        self.conversation = [{"role": "user", "content": _PROBE_USER},
                             {"role": "assistant", "content": _PROBE_ANSWER}]
        base = render_chat(tokenizer, self.conversation, tools=self.tools, add_generation_prompt=False)
        after = base.rfind(_PROBE_ANSWER) + len(_PROBE_ANSWER)
        end = turn_end(base, after, _end_of_turn(tokenizer))
        if after < len(_PROBE_ANSWER) or end is None:
            raise ConfigError(f"{where}: the template does not end an assistant turn with the model's eos "
                              f"({_end_of_turn(tokenizer)}), so a tool turn cannot follow the tokens the model wrote. "
                              "Fix: set the generation eos (generation_config.eos_token_id) to the template's "
                              "end-of-turn token")
        self.head = base[:end]  # everything up to the end of the model's turn
        self.render([("probe", "5")])  # a template that cannot render a tool turn fails here, at start-up

    def render(self, results: Sequence[tuple[str, str]]) -> str:
        """The text after the model's end-of-turn token for these (tool name, result) pairs: the tool turn(s)
        and the next assistant header."""
        messages = self.conversation + [{"role": "tool", "name": name, "content": text} for name, text in results]
        full = render_chat(self.tokenizer, messages, tools=self.tools, add_generation_prompt=True)
        if not full.startswith(self.head):
            raise ConfigError("the chat template renders the turns before a tool turn differently once it is added, "
                              "so the tool turn cannot be appended to the model's tokens. Fix: use a template whose "
                              "earlier turns do not depend on later ones")
        return full[len(self.head):]


def probe_conversation() -> list[dict[str, Any]]:
    """A conversation with a tool call, its result, an answer with a `<think>` block and a second question."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2+3"}}}
    return [{"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": "5"},
            {"role": "assistant", "content": "<think>2+3 is 5.</think>The answer is 5."},
            {"role": "user", "content": "And 2+4?"},
            {"role": "assistant", "content": "<think>6.</think>The answer is 6."}]


def prefix_preserving(tokenizer: Tokenizer, tools: Sequence[Mapping[str, Any]] | None = None) -> tuple[bool, str]:
    """Whether rendering the probe conversation turn by turn only ever appends (turn k's text is a prefix of
    turn k+1's), and if not, where it stops being so."""
    conversation = probe_conversation()
    previous = None
    for k in range(1, len(conversation) + 1):
        try:
            text = render_chat(tokenizer, conversation[:k], tools=tools, add_generation_prompt=False)
        except Exception as e:  # noqa: BLE001 - a template that rejects tool turns: say so, do not stop
            return False, f"the template cannot render turn {k} of the probe ({type(e).__name__}: {e})"
        if previous is not None and not text.startswith(previous):
            role = conversation[k - 1]["role"]
            return False, (f"adding turn {k} ({role}) rewrites the earlier turns (e.g. earlier <think> blocks "
                           "dropped); episodes are token-level and unaffected, a whole-conversation rendering is not")
        previous = text
    return True, f"prefix-preserving over a {len(conversation)}-turn probe with a tool call"


__all__ = ["BUILTIN_TEMPLATES", "HERMES_TEMPLATE", "ToolTurns", "chat_template_text", "prefix_preserving",
           "probe_conversation"]
