"""Tool calls: parsing them out of a model turn, and an environment base class that runs tools.

The default parser, ``hermes``, reads the format of the Qwen and Hermes chat templates::

    <tool_call>
    {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    </tool_call>

Plugins add parsers for other formats through the ``rlcore_tool_parser`` hook:
``register(name, parser)`` where ``parser(text)`` returns a :class:`ParsedTurn`. A malformed call
is never an exception: it becomes a :class:`ToolCallError`, which :class:`ToolEnvironment` turns
into an error observation and a ``tool_errors`` metric.
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rlcore.envs.base import Step, Turn


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallError:
    """A call the parser could not read: the text it found and why."""

    text: str
    reason: str


@dataclass
class ParsedTurn:
    """The calls of a turn in order (well-formed or not), and the text outside them."""

    calls: list = field(default_factory=list)
    content: str = ""

    @property
    def errors(self) -> list[ToolCallError]:
        return [c for c in self.calls if isinstance(c, ToolCallError)]


_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block of ``text`` (an
    unclosed last block counts as a call). ``arguments`` may be a JSON object or a JSON string
    holding one."""
    out = ParsedTurn(content=_CALL.sub("", text).strip())
    for match in _CALL.finditer(text):
        body = match.group(1).strip()
        out.calls.append(_read_call(body))
    return out


def _read_call(body: str):
    try:
        data = json.loads(body)
    except json.JSONDecodeError as error:
        return ToolCallError(body, f"not valid JSON ({error.msg} at character {error.pos})")
    if not isinstance(data, dict):
        return ToolCallError(body, "a tool call must be a JSON object")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        return ToolCallError(body, 'a tool call needs a "name" string')
    arguments = data.get("arguments", data.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return ToolCallError(body, '"arguments" is a string that is not a JSON object')
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return ToolCallError(body, '"arguments" must be a JSON object')
    return ToolCall(name, arguments)


#: The parsers that ship with rlcore (registered by the ``defaults`` plugin).
BUILTIN_PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}


def tool_response(content: str) -> str:
    """The observation text of one tool result, in the Hermes/Qwen form."""
    return f"<tool_response>\n{content}\n</tool_response>"


class ToolEnvironment:
    """An environment whose model turns are tool calls until a turn without one: the answer.

    Subclasses fill :attr:`tools` (name -> ``fn(**arguments) -> str | ToolResult``, may be ``async``) and
    implement :meth:`score` (the reward of the final answer). A turn's calls run in order; each
    result becomes one message of role ``tool`` (the chat template wraps it, e.g. in
    ``<tool_response>``).
    Unknown tools, malformed calls, arguments the tool does not take (checked against its
    signature before it is called) and tools that raise become error text in the observation and
    count as ``tool_errors``; the episode goes on.

    When the episode ends (the environment is done, a limit, or ``env.timeout_s``) the rollout
    calls :meth:`close`, which sets :attr:`closed`: a tool that runs in a thread (a subprocess, a
    request) should stop when it is set; a tool coroutine still running is cancelled.

    Args:
        parser: a parser (``text -> ParsedTurn``); the rollout sets the one named by
            ``env.tool_parser``.
    """

    observation_role = "tool"

    def __init__(self, parser: Optional[Callable[[str], ParsedTurn]] = None):
        self.parser = parser or parse_hermes
        self.row: dict[str, Any] = {}
        self.tools: dict[str, Callable[..., Any]] = {}
        #: Set when the episode ends: tools running in threads stop on it.
        self.closed = threading.Event()

    def start(self, row: dict[str, Any]) -> Optional[list]:
        self.row = row
        return None

    def score(self, answer: str) -> float:
        """The reward of the final answer (a turn without tool calls)."""
        raise NotImplementedError

    async def close(self) -> None:
        """The episode is over: set :attr:`closed` (a tool's thread or subprocess stops on it)."""
        self.closed.set()

    async def step(self, turn: Turn) -> Step:
        import asyncio

        parsed = self.parser(turn.text)
        if not parsed.calls:
            return Step(reward=float(self.score(turn.text)), done=True)
        metrics = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0, "malformed_calls": 0.0}
        results = []
        for call in parsed.calls:
            metrics["tool_calls"] += 1
            if isinstance(call, ToolCallError):
                metrics["tool_errors"] += 1
                metrics["malformed_calls"] += 1
                results.append(f"error: malformed tool call: {call.reason}")
                continue
            fn = self.tools.get(call.name)
            if fn is None:
                metrics["tool_errors"] += 1
                results.append(f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}")
                continue
            problem = bad_arguments(fn, call.arguments)
            if problem is not None:
                metrics["tool_errors"] += 1
                results.append(f"error: bad arguments for {call.name}: {problem}")
                continue
            try:
                out = fn(**call.arguments)
                if inspect.isawaitable(out):
                    out = await out
            except Exception as error:  # noqa: BLE001 - a tool failure is the model's observation
                metrics["tool_errors"] += 1
                results.append(f"error: {call.name} failed: {type(error).__name__}: {error}")
                continue
            if isinstance(out, ToolResult):
                metrics["tool_errors"] += float(out.error)
                metrics["tool_timeouts"] += float(out.timed_out)
                for key, value in out.metrics.items():
                    metrics[key] = metrics.get(key, 0.0) + float(value)
                out = out.text
            results.append(str(out))
        await asyncio.sleep(0)
        return Step(observation=[{"role": "tool", "content": r} for r in results], metrics=metrics)


def bad_arguments(fn: Callable[..., Any], arguments: dict[str, Any]) -> Optional[str]:
    """Why ``fn(**arguments)`` cannot be called (a missing, unknown or repeated argument), or
    ``None`` when the arguments bind to its signature (or it has none that can be read)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins: the call itself will tell
        return None
    try:
        signature.bind(**arguments)
    except TypeError as error:
        return str(error)
    return None


@dataclass(frozen=True)
class ToolResult:
    """A tool's answer with flags for the metrics (a plain string counts as a success); ``metrics``:
    more counters of the call, summed into the step's (``env/<name>``)."""

    text: str
    error: bool = False
    timed_out: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
