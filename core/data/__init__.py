"""Prompt data: the default dataset provider, the streaming parquet dataset, the prompt loader.

* :func:`rlcore.data.provider.build_dataset` — the default answer to ``rlcore_dataset_provider``;
* :func:`rlcore.data.provider.check_data_files` — input checks run before any model loads;
* :func:`rlcore.data.collate.ensure_input_ids` — tokenizes rows that hold only text;
* :class:`rlcore.data.loader.PromptLoader` — endless, sharded, resumable batches of prompts;
* :class:`rlcore.data.streaming.StreamingParquetDataset` — the ``streaming`` plugin's dataset.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "build_dataset": "rlcore.data.provider",
    "check_data_files": "rlcore.data.provider",
    "ensure_input_ids": "rlcore.data.collate",
    "PromptLoader": "rlcore.data.loader",
    "StreamingParquetDataset": "rlcore.data.streaming",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rlcore.data' has no attribute '{name}'")
