"""The process environment a launcher sets (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK`` …) and the
collective timeout, read the same way by the process-group start (:mod:`rlcore.distributed.init`)
and the world split (:mod:`rlcore.distributed.split`)."""

from __future__ import annotations

import os
from datetime import timedelta

from rlcore.errors import PlacementError

ENV_TIMEOUT = "RLCORE_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 600.0


def env_int(name: str, default: int) -> int:
    """The integer in environment variable ``name`` (``default`` when unset or empty).

    :raises PlacementError: the variable does not hold an integer (the message names it).
    """
    raw = os.environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise PlacementError(f"environment variable {name}={raw!r} is not an integer") from e


def collective_timeout() -> timedelta:
    """The process-group timeout: ``RLCORE_DIST_TIMEOUT_S`` seconds (default 600)."""
    raw = os.environ.get(ENV_TIMEOUT, "")
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError as e:
        raise PlacementError(f"environment variable {ENV_TIMEOUT}={raw!r} is not a number of seconds") from e
    if seconds <= 0:
        raise PlacementError(f"environment variable {ENV_TIMEOUT} must be > 0, got {raw!r}")
    return timedelta(seconds=seconds)
