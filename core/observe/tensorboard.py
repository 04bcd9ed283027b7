"""TensorBoard scalars, when ``torch.utils.tensorboard`` (the ``tensorboard`` package) is installed."""

from __future__ import annotations

import logging
import math
from typing import Any, Mapping, Optional

log = logging.getLogger(__name__)


def tensorboard_available() -> bool:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class TensorBoardSink:
    """Writes every finite metric as a scalar; ``val`` metrics go under ``val/``."""

    def __init__(self, log_dir: str, writer: Any = None):
        self.log_dir = log_dir
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=log_dir)
        self.writer = writer

    def write(self, step: int, metrics: Mapping[str, Any], split: str) -> None:
        prefix = "" if split == "train" else f"{split}/"
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self.writer.add_scalar(prefix + key, float(value), int(step))

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


def open_tensorboard(log_dir: str) -> Optional[TensorBoardSink]:
    """A sink for ``log_dir``, or None (logged once) when TensorBoard is not installed."""
    if not tensorboard_available():
        log.info("tensorboard is not installed: metrics go to metrics.jsonl only (pip install tensorboard)")
        return None
    return TensorBoardSink(log_dir)
