"""Small shared pieces of the reward backends: a component's result, sample descriptions, finiteness checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from rlcore.errors import RewardError

#: Characters of a prompt, response or column value shown in an error message.
SHOW_CHARS = 300


@dataclass
class ComponentResult:
    """What one reward component returns for the samples it was given."""

    #: One score per sample, in the order of the samples given.
    scores: list[float]
    #: Samples that raised and received ``reward.fallback_score``.
    errors: int = 0
    #: Samples that exceeded ``reward.timeout_s`` (counted in ``errors`` too).
    timeouts: int = 0
    #: Extra metrics (``reward/...``, ``time/...``).
    metrics: dict[str, float] = field(default_factory=dict)


def _clip(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return repr(text) if len(text) <= SHOW_CHARS else repr(text[:SHOW_CHARS]) + f" … ({len(text)} chars)"


def describe_sample(batch: Any, i: int) -> str:
    """A few indented lines showing sample ``i`` of a :class:`~rlcore.protocols.RewardInput`."""
    lines = [f"    prompt: {_clip(batch.prompts[i])}", f"    response: {_clip(batch.responses[i])}"]
    for key, values in sorted(batch.extras.items()):
        if i < len(values) and not (key == "prompt" and values[i] == batch.prompts[i]):  # shown above already
            lines.append(f"    {key}: {_clip(values[i])}")
    return "\n".join(lines)


def check_batch(batch: Any) -> int:
    """Number of samples of ``batch``; :class:`RewardError` if its lists disagree in length."""
    n = len(batch.responses)
    lengths = {"prompts": len(batch.prompts), "prompt_ids": len(batch.prompt_ids),
               "response_ids": len(batch.response_ids)}
    lengths.update({f"extras['{k}']": len(v) for k, v in batch.extras.items()})
    bad = {k: v for k, v in lengths.items() if v != n}
    if bad:
        raise RewardError(f"reward input has {n} responses but " +
                          ", ".join(f"{v} {k}" for k, v in bad.items()))
    return n


def check_finite(scores: Sequence[float], batch: Any, who: str, indices: Sequence[int] | None = None) -> None:
    """Raise :class:`RewardError` naming the first sample whose score is NaN or infinite.

    :param scores: ``[len(indices)]`` scores of the samples ``indices`` of ``batch`` (all samples when None).
    :param who: the reward's name, for the message.
    """
    for k, s in enumerate(scores):
        if not math.isfinite(s):
            i = indices[k] if indices is not None else k
            raise RewardError(f"reward '{who}' gave {s} for sample {i}; scores must be finite numbers\n"
                              + describe_sample(batch, i))
