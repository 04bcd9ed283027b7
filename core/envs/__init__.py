"""Environments for multi-turn rollouts: the interface (:mod:`~rlcore.envs.base`), tool calls
(:mod:`~rlcore.envs.tools`), the sandbox (:mod:`~rlcore.envs.sandbox`), the built-in environments
(:mod:`~rlcore.envs.builtin`) and the episode runner (:mod:`~rlcore.envs.runner`)."""

from rlcore.envs.base import Environment, Step, Turn
from rlcore.envs.tools import ParsedTurn, ToolCall, ToolCallError, ToolEnvironment, ToolResult, parse_hermes

__all__ = ["Environment", "ParsedTurn", "Step", "ToolCall", "ToolCallError", "ToolEnvironment", "ToolResult", "Turn",
           "parse_hermes"]
