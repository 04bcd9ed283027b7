"""The default world split and rollout source: every rank trains and generates its own rollouts
(:class:`WholeWorld`), drawn, generated and scored in place by :meth:`Trainer.collect
<rlcore.trainer.loop.Trainer.collect>` (:class:`InPlaceSource`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcore.trainer.partial import LoaderState
from rlcore.trainer.sampled import Sampled

if TYPE_CHECKING:
    from rlcore.trainer.loop import Trainer


class WholeWorld:
    """The default :class:`~rlcore.protocols.WorldSplit`: no rollout rank, every rank trains and
    generates its own rollouts."""

    rollout_ranks = 0
    weights_backend = "auto"

    def run_rollout_rank(self, config: Any, split: Any, pm: Any) -> int:
        raise RuntimeError("no rank generates on its own in an unsplit job")

    def rollout_source(self, trainer: "Trainer", split: Any) -> "InPlaceSource":
        return InPlaceSource(trainer)


class InPlaceSource:
    """The default rollout source: :meth:`Trainer.collect` draws this rank's prompts, generates them
    here in the actor's generation layout and scores them."""

    def __init__(self, trainer: "Trainer"):
        self.trainer = trainer

    def next(self, step: int) -> Sampled:
        return self.trainer.collect(step)

    def data_state(self) -> Any:
        return LoaderState(self.trainer.c.prompts.fill)

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self, failed: bool = False) -> None:
        pass
