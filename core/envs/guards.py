"""Guards between the rollout and an environment: what it returns is checked before it is rendered
(an error names the environment), an observation is cut to ``env.max_observation_chars`` before it
is tokenized, and its plain calls run in daemon threads that a call blocked for good cannot keep
alive past the end of the process."""

from __future__ import annotations

import concurrent.futures
import math
import threading
from typing import Any, Callable

from rlcore.envs.base import Step


class DaemonThreads(concurrent.futures.ThreadPoolExecutor):
    """Runs each plain environment call in a daemon thread of its own. A call that never returns (a
    ``step()`` blocked for good) is abandoned when its episode times out and never keeps the process
    from exiting: the threads of a standard pool are joined when the interpreter exits. How many
    run at once is bounded by the runner's semaphore (``env.max_concurrency``). (A pool by type
    only: an event loop's default executor must be one; it starts no thread of its own.)"""

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # noqa: BLE001 - handed to the awaiting episode
                future.set_exception(error)

        threading.Thread(target=run, name="rlcore-env", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to stop: a call still running is left to its daemon thread."""


def message_problem(observation: Any, list_only: bool = False) -> str:
    """What is wrong with an observation (``""``: nothing): text, a message (a mapping with a text
    ``content`` and, if given, a text ``role``), a list of messages, or ``None``; with ``list_only``
    (a ``start()``'s initial messages) a list of messages or ``None``."""
    if observation is None or (not list_only and isinstance(observation, str)):
        return ""
    if isinstance(observation, dict) and not list_only:
        observation = [observation]
    if not isinstance(observation, (list, tuple)):
        want = "a list of messages or None" if list_only else \
            "text, a message {'role': ..., 'content': ...}, a list of messages or None"
        what = "the initial messages are" if list_only else "the observation is"
        return f"{what} {type(observation).__name__} ({_short(observation)}); expected {want}"
    for i, m in enumerate(observation):
        if not isinstance(m, dict):
            return f"message {i} is {type(m).__name__} ({_short(m)}); expected a mapping with 'role' and 'content'"
        if not isinstance(m.get("content"), str):
            return f"message {i} has no text 'content' ({_short(m)})"
        if not isinstance(m.get("role", ""), str):
            return f"message {i} has a 'role' that is not text ({_short(m)})"
    return ""


def step_problem(step: Step) -> str:
    """What is wrong with a :class:`Step` (``""``: nothing), for an error naming its environment."""
    problem = message_problem(step.observation)
    if problem:
        return problem
    if step.reward is not None and (isinstance(step.reward, (str, bytes)) or not _finite(step.reward)):
        return f"the reward is {type(step.reward).__name__} ({_short(step.reward)}); expected a finite number or None"
    if not isinstance(step.metrics, dict):
        return f"metrics is {type(step.metrics).__name__}; expected a mapping of names to numbers"
    for key, value in step.metrics.items():
        if isinstance(value, (str, bytes)) or not _finite(value):
            return f"metric '{key}' is {type(value).__name__} ({_short(value)}); expected a finite number"
    return ""


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


def cap_observation(observation: Any, limit: int) -> tuple[Any, int]:
    """``observation`` with its text cut to ``limit`` characters over all its messages (a note of
    how much was cut ends the last one kept), and the number of characters cut."""
    if observation is None:
        return None, 0
    messages = [observation] if isinstance(observation, (str, dict)) else list(observation)
    contents = [m if isinstance(m, str) else m["content"] for m in messages]
    total = sum(len(c) for c in contents)
    if total <= limit:
        return observation, 0
    out, left = [], int(limit)
    for m, text in zip(messages, contents):
        if left <= 0:
            break
        part = text[:left]
        left -= len(part)
        if left <= 0:
            part += f"\n[observation cut: {total - int(limit)} more characters]"
        out.append(part if isinstance(m, str) else {**m, "content": part})
    return (out[0] if isinstance(observation, (str, dict)) else out), total - int(limit)
