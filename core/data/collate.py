"""Turning prompts into token ids, and the length policy shared by every dataset.

A prompt is plain text, or a list of chat messages (``{"role": ..., "content": ...}``) rendered with
the tokenizer's chat template and a generation prompt. Plain text is tokenized with the tokenizer's
special tokens (a BOS where the model has one); a rendered chat already holds them.

The length policy: a prompt longer than ``max_prompt_length`` is dropped when
``filter_overlong_prompts`` is on (datasets that can drop rows: the default provider, ``streaming``),
otherwise truncated on the ``left`` or ``right``, or rejected (``error``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

from rlcore.config.schema import DataConfig
from rlcore.errors import DataError

log = logging.getLogger(__name__)


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m for m in prompt)


def render_prompts(prompts: Sequence[Any], tokenizer: Any, where: str,
                   first_row: int = 0) -> tuple[list[str], list[bool]]:
    """Render each prompt to text; return the texts and which ones were chats.

    :param where: names the source (file and column) in errors.
    :param first_row: the row number of ``prompts[0]`` in its file (errors name file rows).
    :raises DataError: a value that is neither text nor chat messages, or chats without a chat template.
    """
    texts: list[str] = []
    chats: list[bool] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            texts.append(p)
            chats.append(False)
        elif is_chat(p):
            if not getattr(tokenizer, "chat_template", None):
                raise DataError(f"{where}: row {first_row + i} holds chat messages but the tokenizer has no chat template; "
                                "give plain-text prompts or a tokenizer with a chat_template")
            texts.append(tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=False))
            chats.append(True)
        else:
            raise DataError(f"{where}: row {first_row + i} holds a {type(p).__name__} ({str(p)[:60]!r}); "
                            "expected text or a list of chat messages")
    return texts, chats


def tokenize(texts: list[str], tokenizer: Any, add_special_tokens: bool) -> list[list[int]]:
    """Token ids of ``texts``, without truncation or padding.

    A fast tokenizer whose backend has no truncation or padding set is called directly (the same ids
    as ``tokenizer(texts)``, without building attention masks and a ``BatchEncoding``).
    """
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is not None and backend.truncation is None and backend.padding is None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
    return [list(e) for e in tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]]


def encode_prompts(prompts: Sequence[Any], tokenizer: Any, where: str,
                   first_row: int = 0) -> tuple[list[str], list[list[int]]]:
    """Render and tokenize a batch of prompts; return ``(texts, input_ids)`` (``first_row``: see
    :func:`render_prompts`)."""
    texts, chats = render_prompts(prompts, tokenizer, where, first_row)
    ids: list[list[int]] = [[] for _ in texts]
    for flag in (False, True):
        idx = [i for i, c in enumerate(chats) if c == flag]
        if idx:
            for i, e in zip(idx, tokenize([texts[i] for i in idx], tokenizer, add_special_tokens=not flag)):
                ids[i] = e
    return texts, ids


@dataclass
class LengthStats:
    """What the length policy did to a batch (counts)."""

    rows: int = 0
    dropped: int = 0
    truncated: int = 0
    longest: int = 0

    def add(self, other: "LengthStats") -> None:
        self.rows += other.rows
        self.dropped += other.dropped
        self.truncated += other.truncated
        self.longest = max(self.longest, other.longest)


def apply_length_policy(ids: list[list[int]], config: DataConfig, where: str, *, can_drop: bool = True,
                        first_row: int = 0) -> tuple[list[int], list[list[int]], LengthStats]:
    """Apply ``max_prompt_length`` to a batch (``first_row``: the file row of ``ids[0]``, for errors).

    :returns: indices of the rows kept, their (possibly truncated) ids, and the counts.
    :raises DataError: prompts without a single token; overlong rows under ``truncation=error``
        (when they are not filtered).
    """
    empty = [i for i, x in enumerate(ids) if len(x) == 0]
    if empty:
        raise DataError(f"{where}: {len(empty)} of {len(ids)} prompt(s) give no tokens (first at row {first_row + empty[0]}): "
                        f"empty text in column '{config.prompt_key}' (data.prompt_key), or a tokenizer that does "
                        "not cover the data (is actor.model_path set?)")
    limit = int(config.max_prompt_length)
    stats = LengthStats(rows=len(ids), longest=max((len(x) for x in ids), default=0))
    over = [i for i, x in enumerate(ids) if len(x) > limit]
    if not over:
        return list(range(len(ids))), ids, stats
    if config.filter_overlong_prompts and can_drop:
        drop = set(over)
        keep = [i for i in range(len(ids)) if i not in drop]
        stats.dropped = len(over)
        return keep, [ids[i] for i in keep], stats
    if config.truncation == "error":
        raise DataError(f"{where}: {len(over)} of {len(ids)} prompt(s) exceed data.max_prompt_length={limit} tokens "
                        f"(longest {stats.longest}, first at row {first_row + over[0]}); set data.truncation=left|right"
                        + ("" if can_drop else " (rows of a custom dataset cannot be filtered)")
                        + " or raise data.max_prompt_length")
    out = list(ids)
    for i in over:
        out[i] = ids[i][-limit:] if config.truncation == "left" else ids[i][:limit]
    stats.truncated = len(over)
    return list(range(len(ids))), out, stats


def ensure_input_ids(rows: list[dict], tokenizer: Any, config: DataConfig, *, drop_overlong: bool = False) -> list[dict]:
    """Give every row ``input_ids`` (rows of custom datasets often hold only text) within the length limit.

    Overlong prompts are dropped when ``drop_overlong`` and ``data.filter_overlong_prompts`` are both
    on (the caller refills the batch, see :class:`BatchFiller`); otherwise they are truncated by
    ``data.truncation`` or rejected when it is ``error``.
    """
    key = config.prompt_key
    todo = [i for i, r in enumerate(rows) if r.get("input_ids") is None]
    out = [dict(r) for r in rows]
    if todo:
        missing = [i for i in todo if key not in rows[i]]
        if missing:
            raise DataError(f"dataset row has no column '{key}' (data.prompt_key) and no input_ids; "
                            f"columns: {', '.join(sorted(rows[missing[0]]))}")
        texts, ids = encode_prompts([rows[i][key] for i in todo], tokenizer, f"column '{key}'")
        for i, t, x in zip(todo, texts, ids):
            out[i][key], out[i]["input_ids"] = t, x
    ids = [list(r["input_ids"]) for r in out]
    keep, ids, stats = apply_length_policy(ids, config, f"column '{key}'", can_drop=drop_overlong)
    if stats.truncated:
        log.info("truncated %d of %d prompt(s) to %d tokens (%s)", stats.truncated, len(rows),
                 config.max_prompt_length, config.truncation)
    if stats.dropped:
        log.info("dropped %d of %d prompt(s) over data.max_prompt_length=%d tokens (data.filter_overlong_prompts)",
                 stats.dropped, len(rows), config.max_prompt_length)
    out = [out[i] for i in keep]
    for r, x in zip(out, ids):
        r["input_ids"] = x
    return out


class BatchFiller:
    """Training batches of exactly ``size`` prompts from ``loader`` when rows are dropped after loading
    (overlong prompts of a custom dataset with ``data.filter_overlong_prompts``).

    Called with a batch the loader gave, it tokenizes the rows, drops the overlong ones and takes
    more from the loader's next batches until the batch is full; rows left over open the next
    batch. Its checkpoint state is the loader's position plus those carried rows, so a resumed
    run starts with them (unless the world size changed: the carried rows are then dropped, as
    the loader restarts its epoch).
    """

    def __init__(self, loader: Any, tokenizer: Any, config: DataConfig, size: int):
        self.loader, self.tokenizer, self.config, self.size = loader, tokenizer, config, int(size)
        self._carry: list[dict] = []

    def state_dict(self) -> dict[str, Any]:
        """The loader's state with the rows carried into the next batch (``carry``)."""
        return {**self.loader.state_dict(), "carry": [dict(row) for row in self._carry]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the loader's position and the carried rows (none in checkpoints without them)."""
        self.loader.load_state_dict(state)
        same_world = state.get("world_size") == self.loader.dist.world_size
        self._carry = [dict(row) for row in state.get("carry", [])] if same_world else []

    def __call__(self, rows: list[dict]) -> list[dict]:
        kept = self._carry + ensure_input_ids(rows, self.tokenizer, self.config, drop_overlong=True)
        first_epoch = getattr(self.loader, "epoch", 0)
        while len(kept) < self.size:
            if getattr(self.loader, "epoch", 0) - first_epoch >= 2:
                raise DataError(f"a whole epoch of the training data gave fewer than {self.size} prompts within "
                                f"data.max_prompt_length={self.config.max_prompt_length} tokens (the rest were "
                                "dropped by data.filter_overlong_prompts): raise the limit or set "
                                "data.filter_overlong_prompts=false with data.truncation=left|right")
            kept += ensure_input_ids(self.loader.next_batch(), self.tokenizer, self.config, drop_overlong=True)
        self._carry = kept[self.size:]
        return kept[:self.size]


def list_collate(batch: list) -> list:
    """DataLoader collate that keeps rows as a list of dicts."""
    return list(batch)
