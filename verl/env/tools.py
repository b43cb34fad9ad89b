"""Tools an environment offers the model, declared as JSON schemas in the OpenAI function format.

    Tool(name="calculator", description="Evaluate an arithmetic expression.",
         parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                     "required": ["expression"]},
         function=lambda expression: str(evaluate(expression)))

`schema` is what `tokenizer.apply_chat_template(tools=[...])` and an OpenAI client take. Schemas are checked
with `jsonschema` when the environment is built (a schema that is not JSON schema fails then, naming the tool),
and every call's arguments against its schema before the function runs: a call with a wrong argument is an
error result the model reads, as a function that raises is, never a crash of the run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from verl.data.tool_parsers import ToolCall
from verl.errors import ConfigError
from verl.utils.suggest import did_you_mean


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: Mapping[str, Any]  # the arguments' JSON schema (an object schema)
    function: Callable[..., Any]  # called with the arguments as keywords; its result is shown as text

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function format, as chat templates and OpenAI clients take tools."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolResult:
    text: str
    error: bool = False


def check_tools(tools: Sequence[Tool], where: str) -> dict[str, Tool]:
    """`tools` by name, each schema checked; `where` names their owner in errors (e.g. the environment)."""
    from jsonschema import Draft202012Validator, SchemaError

    out: dict[str, Tool] = {}
    for i, tool in enumerate(tools):
        if not isinstance(tool, Tool):
            raise ConfigError(f"{where}: tools[{i}] is a {type(tool).__name__}; declare each tool as "
                              "verl.env.tools.Tool(name, description, parameters, function)")
        if not tool.name or not tool.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"{where}: tool name {tool.name!r} must be letters, digits, '_' or '-' (the OpenAI "
                              "function format)")
        if tool.name in out:
            raise ConfigError(f"{where}: two tools are named {tool.name!r}; tool names must be unique")
        if not callable(tool.function):
            raise ConfigError(f"{where}: tool {tool.name!r} has no callable function")
        params = tool.parameters
        if not isinstance(params, Mapping) or params.get("type") != "object":
            raise ConfigError(f"{where}: tool {tool.name!r}: parameters must be a JSON schema of type 'object' "
                              f'(e.g. {{"type": "object", "properties": {{...}}, "required": [...]}}), got '
                              f"{json.dumps(params, default=str)[:120]}")
        try:
            Draft202012Validator.check_schema(dict(params))
        except SchemaError as e:
            path = "/".join(str(p) for p in e.path) or "(top)"
            raise ConfigError(f"{where}: tool {tool.name!r}: parameters is not a valid JSON schema at {path}: "
                              f"{e.message}. Fix the schema (https://json-schema.org)") from None
        out[tool.name] = tool
    return out


def run_tool(tools: Mapping[str, Tool], call: ToolCall) -> ToolResult:
    """The call's result: the function's, or an error the model reads (unknown tool, arguments that do not
    fit the schema, a function that raised)."""
    from jsonschema import Draft202012Validator

    tool = tools.get(call.name)
    if tool is None:
        hint = did_you_mean(call.name, tools)
        return ToolResult(f"error: no tool named {call.name!r}; the tools are {', '.join(sorted(tools))}.{hint}",
                          error=True)
    problems = sorted(Draft202012Validator(dict(tool.parameters)).iter_errors(call.arguments),
                      key=lambda e: list(e.path))
    if problems:
        where = "/".join(str(p) for p in problems[0].path)
        return ToolResult(f"error: {call.name} arguments{' at ' + where if where else ''}: {problems[0].message}",
                          error=True)
    try:
        result = tool.function(**call.arguments)
    except Exception as e:  # noqa: BLE001 - the tool's failure is the model's observation
        return ToolResult(f"error: {call.name} raised {type(e).__name__}: {e}", error=True)
    return ToolResult(result if isinstance(result, str) else json.dumps(result, default=str))


def python_tool(*, timeout_s: float = 10.0, memory_mb: int = 512, max_output_chars: int = 2000,
                name: str = "python") -> Tool:
    """A tool that runs the model's Python in verl.sandbox and answers with what it printed (stdout, then
    stderr), cut to `max_output_chars`; a timeout, memory limit or kill is said in the answer, for the model
    to read, as an error result."""
    from verl.sandbox import run_code

    def run(code: str) -> str:
        result = run_code(code, timeout_s=timeout_s, memory_mb=memory_mb,
                          max_output_bytes=max(1 << 16, 4 * max_output_chars))
        text = (result.stdout + ("\n" + result.stderr if result.stderr else "")).strip()
        if len(text) > max_output_chars:
            text = text[:max_output_chars] + f"... ({len(text) - max_output_chars} more characters)"
        if result.status in ("ok", "error"):  # an exception's traceback is the model's to read
            return text or "(no output)"
        raise RuntimeError(f"the code {result.reason}" + (f"; output before that: {text}" if text else ""))

    return Tool(name=name, description="Run a Python program (standard library only) and see what it prints.",
                parameters={"type": "object", "properties": {"code": {"type": "string",
                                                                      "description": "The Python source to run."}},
                            "required": ["code"]},
                function=run)


__all__ = ["Tool", "ToolResult", "check_tools", "python_tool", "run_tool"]
