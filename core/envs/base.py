"""What an environment is: the small interface multi-turn rollouts drive.

An environment plays one episode with the model. The rollout starts it from a dataset row, then
alternates: the model writes a turn (until EOS or a stop string such as ``</tool_call>``), the
environment answers with an observation, a reward or none, and whether the episode is over. The
observation is rendered with the tokenizer's chat template and appended to the sequence as
context (masked out of the loss); generation continues after it.

An environment may also have ``close()``: called once when its episode ends (the environment said
done, a limit was reached, or it took longer than ``env.timeout_s``), to stop what it still runs.

Each method may be a plain function or a coroutine (``async def``): coroutines run concurrently on
the rollout's event loop, plain functions in its worker threads, so a slow tool never stalls the
decoding of the other sequences.

Environments are registered by plugins through the ``rlcore_environment`` hook as *factories*:
``register(name, factory)`` where ``factory(config)`` returns a fresh :class:`Environment` for one
episode and ``config`` is the ``plugin_config.<name>`` section as a plain ``dict``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Union, runtime_checkable

#: A chat message: ``{"role": ..., "content": ...}``.
Message = dict

#: The keys of ``plugin_config.<name>`` that the rollout reads itself (per-episode limits).
LIMIT_KEYS = ("max_turns", "max_tokens")


@dataclass(frozen=True)
class Turn:
    """One model turn: its text (special tokens dropped), its token ids, and its 0-based index."""

    text: str
    token_ids: tuple[int, ...]
    index: int
    #: The turn reached the episode's token limit (``env.max_tokens``): the backend stopped it there,
    #: on EOS, a stop string or not; the episode ends after this turn.
    truncated: bool = False


@dataclass
class Step:
    """An environment's answer to a turn.

    ``observation``: text (sent as one message of the environment's ``observation_role``, default
    ``"user"``), a list of messages, or ``None`` (nothing to add; only sensible with ``done``).
    ``reward``: a score for this turn or ``None``; an episode's reward is the sum of its turns'.
    ``metrics``: counters summed over the batch's episodes (``tool_calls``, ``tool_errors``,
    ``tool_timeouts`` …) and reported as ``env/<name>``.
    """

    observation: Union[str, list, None] = None
    reward: Optional[float] = None
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (methods may be ``async``)."""

    def start(self, row: dict[str, Any]) -> Optional[list]:
        """Begin an episode from a dataset row. Return the initial chat messages (rendered with the
        chat template into the prompt), or ``None`` to use the row's prompt as the data pipeline
        tokenized it."""
        ...

    def step(self, turn: Turn) -> Step:
        """Answer the model's turn."""
        ...
