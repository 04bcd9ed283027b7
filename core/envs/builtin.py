"""The environments that ship with rlcore (registered by the ``defaults`` plugin).

* ``python`` — a tool environment with one tool, ``python(code)``, run in the sandbox of
  :mod:`rlcore.envs.sandbox`; the final answer (a turn without a tool call) is compared with the
  row's answer column.
* ``guess`` — a multi-turn task without tools: guess a number in ``[low, high]``, told "higher"
  or "lower" after each wrong guess.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading
from typing import Any, Optional

from rlcore.envs.base import Step, Turn
from rlcore.envs.sandbox import STRICT_GUARDS, SandboxLimits, run_python, sandbox_level
from rlcore.envs.tools import ToolEnvironment, ToolResult

log = logging.getLogger(__name__)
#: The values of ``env.python.sandbox``.
SANDBOX_MODES = ("strict", "best-effort")
_logged = threading.Event()  # the guards of a best-effort sandbox are logged once per process

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _config_error(env: str, key: str, problem: str) -> ValueError:
    return ValueError(f"plugin_config.{env}.{key}: {problem}")


def _take(config: dict, env: str, allowed: dict[str, Any]) -> dict[str, Any]:
    """``config`` over the defaults of ``allowed``; an unknown key is an error naming it."""
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise _config_error(env, unknown[0], f"not a setting of the '{env}' environment; settings: "
                                             f"{', '.join(sorted(allowed))}")
    return {**allowed, **config}


def answers_match(answer: str, expected: Any) -> bool:
    """Whether ``answer`` states ``expected``: the last number of the answer equals it numerically,
    or (for text) the stripped, case-folded texts are equal."""
    expected_text = str(expected).strip()
    try:
        target = float(expected_text)
    except ValueError:
        return answer.strip().casefold() == expected_text.casefold()
    numbers = _NUMBER.findall(answer.replace(",", ""))
    return bool(numbers) and abs(float(numbers[-1]) - target) <= 1e-6 * max(1.0, abs(target))


def check_python_sandbox(mode: str, used_by: str = "") -> None:
    """``env.python.sandbox`` against this host: with ``strict``, an :class:`~rlcore.errors.EnvError`
    where the sandbox cannot give the code namespaces and a filesystem of its own (``used_by``: what
    uses the ``python`` environment, for the message). Finds the host's level once per process."""
    from rlcore.errors import EnvError

    if mode not in SANDBOX_MODES:
        raise EnvError(f"env.python.sandbox: {mode!r} is not one of {', '.join(SANDBOX_MODES)}")
    if mode != "strict":
        return
    level = sandbox_level()
    if not level.strict:
        missing = ", ".join(sorted(STRICT_GUARDS - set(level.guards)))
        raise EnvError(f"the 'python' environment{' (' + used_by + ')' if used_by else ''} needs a strict sandbox "
                       f"(env.python.sandbox: strict) and this host gives {level.describe()}, without {missing}: "
                       "allow user namespaces (or install bubblewrap: pip install 'rlcore[sandbox]'), or set "
                       "env.python.sandbox=best-effort to run with the guards it has (docs/environments.md)")


def with_sandbox_mode(plugin_config: dict, mode: str) -> dict:
    """``plugin_config`` with ``env.python.sandbox`` (``mode``) handed to the ``python`` environment."""
    from rlcore.errors import EnvError

    section = dict(plugin_config.get("python") or {})
    if "sandbox" in section:
        raise EnvError("plugin_config.python.sandbox: the sandbox level is set by env.python.sandbox")
    return {**plugin_config, "python": {**section, "sandbox": str(mode)}}


class PythonToolEnv(ToolEnvironment):
    """``python``: run code in the sandbox; the reward is 1 when the final answer matches the row's
    ``answer_key`` column (default ``ground_truth``), else 0.

    Settings (``plugin_config.python``): ``answer_key``, ``timeout_s``, ``cpu_s``, ``memory_mb``,
    ``max_output_bytes``, ``disk_mb`` (see :class:`~rlcore.envs.sandbox.SandboxLimits`), ``paths``
    (files and directories the code may also read and import from). ``sandbox`` is set by the trainer
    from ``env.python.sandbox`` (:data:`SANDBOX_MODES`): ``strict`` refuses to start on a host without
    the strict guards and never shows the model a run that lacked them."""

    DEFAULTS = {"answer_key": "ground_truth", "timeout_s": 5.0, "cpu_s": 5, "memory_mb": 512,
                "max_output_bytes": 2048, "disk_mb": 64, "paths": [], "sandbox": "strict"}

    def __init__(self, config: Optional[dict] = None):
        super().__init__()
        cfg = _take(dict(config or {}), "python", self.DEFAULTS)
        self.answer_key = str(cfg["answer_key"])
        try:
            self.limits = SandboxLimits(timeout_s=float(cfg["timeout_s"]), cpu_s=int(cfg["cpu_s"]),
                                        memory_mb=int(cfg["memory_mb"]), disk_mb=int(cfg["disk_mb"]),
                                        max_output_bytes=int(cfg["max_output_bytes"]))
        except ValueError as error:
            raise _config_error("python", "limits", str(error)) from None
        if not isinstance(cfg["paths"], (list, tuple)) or not all(isinstance(p, str) for p in cfg["paths"]):
            raise _config_error("python", "paths", f"a list of paths, got {cfg['paths']!r}")
        self.paths = tuple(cfg["paths"])
        self.sandbox = str(cfg["sandbox"])
        if self.sandbox not in SANDBOX_MODES:
            raise _config_error("python", "sandbox", f"{self.sandbox!r} is not one of {', '.join(SANDBOX_MODES)} "
                                                     "(set by env.python.sandbox)")
        self.tools = {"python": self.python}

    def start(self, row: dict[str, Any]) -> Optional[list]:
        check_python_sandbox(self.sandbox)  # the host's level is found once; a weak one stops a strict run here
        return super().start(row)

    async def python(self, code: str) -> ToolResult:
        # an episode that ends (env.timeout_s, a limit) sets ``closed``: the run is stopped then
        result = await asyncio.to_thread(run_python, str(code), self.limits, cancel=self.closed, paths=self.paths)
        strict = STRICT_GUARDS <= set(result.guards)
        metrics = {"sandbox_strict": float(strict), "sandbox_weak": float(not strict)}
        if not strict and self.sandbox == "strict":  # never show the model what a weaker sandbox let through
            missing = ", ".join(sorted(STRICT_GUARDS - set(result.guards)))
            log.error("python tool: a sandbox run lacked the strict guards (%s); its output is withheld", missing)
            return ToolResult(f"error: the sandbox could not isolate this run (without {missing}); its output is "
                              "withheld", error=True, metrics=metrics)
        if not strict and not _logged.is_set():
            _logged.set()
            log.warning("python tool (env.python.sandbox=best-effort): the sandbox runs with the guards %s, "
                        "without %s (docs/environments.md says what each holds)", ", ".join(result.guards) or "none",
                        ", ".join(sorted(STRICT_GUARDS - set(result.guards))))
        return ToolResult(result.describe() or "(no output)", error=not result.ok, timed_out=result.timed_out,
                          metrics=metrics)

    def score(self, answer: str) -> float:
        if self.answer_key not in self.row:
            raise KeyError(f"the 'python' environment scores against column '{self.answer_key}' "
                           f"(plugin_config.python.answer_key), which this row lacks; columns: "
                           f"{', '.join(sorted(self.row))}")
        return float(answers_match(answer, self.row[self.answer_key]))


class GuessEnv:
    """``guess``: the row's ``secret`` column (or a number drawn from the row's ``seed`` column, or
    at random) in ``[low, high]``; each turn's last number is a guess, answered ``higher``,
    ``lower`` or ``correct``. Reward 1 for a correct guess, 0 when the turns run out.

    Settings (``plugin_config.guess``): ``low`` (1), ``high`` (100)."""

    observation_role = "user"
    DEFAULTS = {"low": 1, "high": 100}

    def __init__(self, config: Optional[dict] = None):
        cfg = _take(dict(config or {}), "guess", self.DEFAULTS)
        self.low, self.high = int(cfg["low"]), int(cfg["high"])
        if self.low > self.high:
            raise _config_error("guess", "low", f"{self.low} is above high {self.high}")
        self.secret = self.low

    def start(self, row: dict[str, Any]) -> Optional[list]:
        if row.get("secret") is not None:
            self.secret = int(row["secret"])
        else:
            self.secret = random.Random(row.get("seed")).randint(self.low, self.high)
        return None

    def step(self, turn: Turn) -> Step:
        numbers = _NUMBER.findall(turn.text)
        if not numbers:
            return Step(observation=f"Say a whole number between {self.low} and {self.high}.",
                        metrics={"invalid_guesses": 1.0})
        guess = int(float(numbers[-1]))
        if guess == self.secret:
            return Step(observation="correct", reward=1.0, done=True)
        return Step(observation="higher" if guess < self.secret else "lower", metrics={"wrong_guesses": 1.0})


#: Built-in environment factories by name: ``factory(config) -> environment``.
BUILTIN_ENVIRONMENTS = {"python": PythonToolEnv, "guess": GuessEnv}
