"""Exceptions raised for user-facing problems. Each names the file, key or plugin at fault."""

from __future__ import annotations

from typing import Sequence


#: Exit codes of ``rlcore`` commands (see docs/observability.md, "Exit codes").
EXIT_OK = 0
#: An unexpected failure (a bug or a crash in a plugin): the traceback is printed.
EXIT_CRASH = 1
#: A user-facing error (config, data, checkpoint, reward, diverged training), printed without a traceback.
EXIT_ERROR = 2
#: The run stopped early on SIGTERM/SIGINT after saving a checkpoint; the same command resumes it.
EXIT_INTERRUPTED = 75
#: Stopped at once by a second Ctrl-C (no checkpoint of the current step).
EXIT_KEYBOARD = 130


class RLCoreError(Exception):
    """Base of every user-facing rlcore error; the CLI prints it without a traceback."""


class ConfigError(RLCoreError, ValueError):
    """One or more configuration problems, reported together."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"{n} configuration problem{'s' if n != 1 else ''}:"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


class PluginError(RLCoreError):
    """A plugin could not be found, imported or combined with the others."""


class DataError(RLCoreError, ValueError):
    """Input data is missing, unreadable or unusable."""


class RewardError(RLCoreError):
    """A reward function or model failed or returned an invalid score."""


class CheckpointError(RLCoreError):
    """A checkpoint could not be written or read."""


class EnvError(RLCoreError):
    """An environment is unknown, misconfigured, or failed during an episode."""


class PlacementError(RLCoreError, ValueError):
    """Roles cannot be placed on the devices or ranks available."""


class PreflightError(RLCoreError):
    """Several problems found by the checks that run before a model loads, reported together."""

    def __init__(self, problems: Sequence[Exception]):
        self.problems = list(problems)
        items: list[str] = []
        for problem in self.problems:  # a ConfigError's own list joins this one, item by item
            inner = getattr(problem, "problems", None)
            if isinstance(problem, ConfigError) and inner:
                items += [str(p) for p in inner]
            else:
                items.append(str(problem) or type(problem).__name__)
        lines = [f"{len(items)} problems found before loading anything:"]
        for item in items:
            text = item.splitlines() or [""]
            lines += [f"  - {text[0]}"] + [f"    {line}" for line in text[1:]]
        super().__init__("\n".join(lines))


class TrainingError(RLCoreError):
    """Training cannot go on: e.g. the loss or gradients stayed non-finite (the run diverged)."""
