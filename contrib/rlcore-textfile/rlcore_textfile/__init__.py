"""rlcore plugin: prompts from plain-text files, one per line (see README.md).

Registered as ``textfile`` in the ``rlcore.plugins`` entry-point group; it implements one hook,
``rlcore_dataset_provider``, and passes (returns None) unless every file of the split is ``.txt``.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from rlcore.hookspecs import hookimpl

__version__ = "0.1.0"
SUFFIX = ".txt"
log = logging.getLogger(__name__)


def _unescape(text: str) -> str:
    return text.replace("\\t", "\t").replace("\\n", "\n")


def read_prompt_file(path: str) -> list[dict[str, Any]]:
    """Rows of one file: ``prompt``, optional ``ground_truth`` (after a tab), ``data_source`` and ``line``."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line.strip():
                continue
            prompt, sep, answer = line.partition("\t")
            row = {"prompt": _unescape(prompt), "data_source": f"textfile:{path}", "line": lineno}
            if sep:
                row["ground_truth"] = _unescape(answer)
            rows.append(row)
    return rows


class TextFileDataset:
    """Map-style dataset of the prompts of ``.txt`` files, tokenized and length-checked up front."""

    def __init__(self, paths: list[str], config: Any, tokenizer: Any, key: str):
        from rlcore.data.collate import apply_length_policy, encode_prompts
        from rlcore.errors import DataError

        rows = [r for p in paths for r in read_prompt_file(p)]
        if not rows:
            raise DataError(f"{key}: the dataset is empty: {len(paths)} text file(s) hold no prompt line "
                            f"({', '.join(paths[:5])})")
        texts, ids = encode_prompts([r["prompt"] for r in rows], tokenizer, f"{key} ({len(paths)} text file(s))")
        keep, ids, stats = apply_length_policy(ids, config, f"{key} ({', '.join(paths[:3])})")
        if not keep:
            raise DataError(f"{key}: every prompt is longer than data.max_prompt_length={config.max_prompt_length} "
                            f"tokens ({stats.dropped} of {stats.rows} lines, longest {stats.longest})")
        if stats.dropped:
            log.warning("%s: dropped %d of %d prompt line(s) over max_prompt_length", key, stats.dropped, stats.rows)
        self.rows = []
        for i, x in zip(keep, ids):
            row = dict(rows[i])
            row.pop("prompt")
            row[config.prompt_key], row["input_ids"] = texts[i], x
            self.rows.append(row)
        self.stats = stats

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self.rows[i])


@hookimpl
def rlcore_dataset_provider(config, tokenizer, split, dist) -> Optional[TextFileDataset]:
    from rlcore.data.files import resolve_files

    key = f"data.{split}_files"
    spec = config.train_files if split == "train" else config.val_files
    if config.custom_cls.path or not spec:
        return None
    paths = resolve_files(spec, key)
    if not paths or not all(p.lower().endswith(SUFFIX) for p in paths):
        return None
    return TextFileDataset(paths, config, tokenizer, key)
