"""Tool calls in the formats chat models write them, parsed from a model turn's text (and written, for warm-start
data and tests).

- ``hermes``: Qwen2.5, Qwen3, Hermes and most open chat models: each call is
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any number per turn, with text around them.
- ``llama3_json``: Llama 3.1/3.2/3.3 with JSON tool calling: the turn *is* the call, a JSON object
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``); several are joined by ``;``.

A call the parser cannot read (not JSON, no name, arguments that are not an object, an unclosed tag) is not an
exception: it comes back in `ParsedTurn.errors`, for the environment to answer with an error observation the
model learns from, and to count.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl.errors import ConfigError
from verl.utils.suggest import did_you_mean


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    content: str  # the turn's text outside its calls
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one line per call that could not be read

    @property
    def wants_tools(self) -> bool:
        """Whether the model tried to call a tool (even if the call could not be read)."""
        return bool(self.calls or self.errors)


def _call_from(obj: Any, arguments_key: str) -> ToolCall | str:
    """A ToolCall from a decoded JSON value, or why it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return 'a tool call needs a "name" string'
    args = obj.get(arguments_key, obj.get("arguments" if arguments_key != "arguments" else "parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return f'the "{arguments_key}" of {name} are a string that is not JSON ({e.msg})'
    if not isinstance(args, dict):
        return f'the "{arguments_key}" of {name} must be a JSON object, got {type(args).__name__}'
    return ToolCall(name, args)


def _decode(text: str, arguments_key: str) -> ToolCall | str:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {text.strip()[:80]!r}"
    return _call_from(obj, arguments_key)


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    calls, errors, content = [], [], []
    last = 0
    for match in _HERMES.finditer(text):
        content.append(text[last:match.start()])
        last = match.end()
        call = _decode(match.group(1), "arguments")
        (calls if isinstance(call, ToolCall) else errors).append(call)
    rest = text[last:]
    if "<tool_call>" in rest:  # opened, never closed (the turn ran out, or the model forgot the tag)
        errors.append("a <tool_call> tag is not closed with </tool_call>")
        rest = rest[: rest.index("<tool_call>")]
    content.append(rest)
    return ParsedTurn("".join(content).strip(), calls, errors)


def format_hermes(calls: Sequence[ToolCall], content: str = "") -> str:
    parts = [content] if content else []
    parts += [f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>" for c in calls]
    return "\n".join(parts)


PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> ParsedTurn:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return ParsedTurn(text.strip())
    calls, errors = [], []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            errors.append(f"the tool call is not valid JSON ({e.msg} at character {e.pos}): {body[pos:][:80]!r}")
            break
        call = _call_from(obj, "parameters")
        (calls if isinstance(call, ToolCall) else errors).append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return ParsedTurn("", calls, errors)


def format_llama3_json(calls: Sequence[ToolCall], content: str = "") -> str:
    return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls) or content


@dataclass(frozen=True)
class ToolCallFormat:
    parse: Callable[[str], ParsedTurn]
    format: Callable[..., str]


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat(parse_hermes, format_hermes),
    "llama3_json": ToolCallFormat(parse_llama3_json, format_llama3_json),
}


def tool_call_format(name: str) -> ToolCallFormat:
    """The format registered under `name`; an unknown name is refused with the known ones."""
    if name not in FORMATS:
        raise ConfigError(f"unknown tool-call format {name!r}; known: {', '.join(sorted(FORMATS))} (hermes: "
                          f"Qwen2.5/Qwen3/Hermes, llama3_json: Llama 3.x).{did_you_mean(name, FORMATS)}")
    return FORMATS[name]


def register_tool_call_format(name: str, parse: Callable[[str], ParsedTurn], format: Callable[..., str]) -> None:
    """Add a format (a model family whose calls look otherwise)."""
    FORMATS[name] = ToolCallFormat(parse, format)


__all__ = ["FORMATS", "ParsedTurn", "ToolCall", "ToolCallFormat", "format_hermes", "format_llama3_json",
           "parse_hermes", "parse_llama3_json", "register_tool_call_format", "tool_call_format"]
