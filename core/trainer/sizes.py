"""The update's view of its samples' sizes, read to the host once an update: length grouping, trimming
each micro-batch (:meth:`SampleSizes.used`) and the padding share (``actor/padding_frac``) plan from
them without a device read a micro-batch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rlcore.trainer import aligned
from rlcore.trainer.experience import Experience, end_of_set, first_set, rows_used


class SampleSizes(NamedTuple):
    """Each sample's sizes on the host (:func:`host_sizes`)."""

    prompt: torch.Tensor  # prompt tokens
    response: torch.Tensor  # response columns up to its last attended one
    width: int  # columns of a row
    tokens: torch.Tensor  # attended tokens (prompt and response)
    prompt_width: int  # prompt columns of a row
    first: torch.Tensor  # first used prompt column (experience.row_columns)
    kept: torch.Tensor  # one past the last trained response column (experience.row_columns)
    trained: torch.Tensor  # trained response tokens

    def known(self, idx: torch.Tensor) -> aligned.KnownRows:
        """:class:`~rlcore.trainer.aligned.KnownRows` of the samples ``idx``: their longest row where each
        row's tokens are contiguous (from its first prompt column to its last response column; a row
        without response tokens attended is not known to be), and their trained tokens."""
        idx = idx.cpu()
        tokens, response, first = self.tokens[idx], self.response[idx], self.first[idx]
        contiguous = bool(((response > 0) & (tokens > 0) & (tokens == self.prompt_width + response - first)).all())
        longest = int(tokens.max()) if contiguous and len(idx) else None
        return aligned.KnownRows(longest, int(self.trained[idx].sum()))

    def used(self, idx: torch.Tensor) -> tuple[int, int]:
        """:func:`~rlcore.trainer.experience.used_columns` of the samples ``idx``, from the host."""
        idx = idx.cpu()
        return rows_used(self.first[idx], self.kept[idx], self.prompt_width)

    def shapes(self, idx: torch.Tensor) -> tuple[tuple[int, int], aligned.KnownRows]:
        """``(used, known)`` of the samples ``idx``: what cuts and shapes their forward on the host."""
        return self.used(idx), self.known(idx)


def host_sizes(exp: Experience) -> SampleSizes:
    """The sizes of ``exp``'s samples, read to the host in one transfer (the update then plans on the host)."""
    mask = exp.attention_mask
    width = mask.shape[1]
    prompt_width = width - exp.response_mask.shape[1]
    tokens, prompt, response, first, kept, trained = torch.stack([
        mask.sum(-1).long(), mask[:, :prompt_width].sum(-1).long(), end_of_set(mask[:, prompt_width:]),
        first_set(mask[:, :prompt_width]), end_of_set(exp.response_mask), exp.response_mask.bool().sum(-1)]).cpu()
    return SampleSizes(prompt, response, int(width), tokens, int(prompt_width), first, kept, trained)


def padding_share(groups: list[torch.Tensor], sizes: SampleSizes, packed: bool, trim: bool) -> float:
    """Share of the token positions the micro-batches ``groups`` compute that are padding, counted as
    the update counts a forward's tokens: none packed; rows x the longest row with the rows moved left
    (:mod:`rlcore.trainer.aligned`); rows x (longest prompt + longest response) trimmed, else rows x the
    full width."""
    real = computed = 0
    for group in groups:
        idx = group.cpu()
        if not len(idx):
            continue
        own = int(sizes.tokens[idx].sum())
        real += own
        if packed:
            computed += own
        elif aligned.ENABLED:
            computed += len(idx) * int(sizes.tokens[idx].max())
        elif trim:
            computed += len(idx) * int(sizes.prompt[idx].max() + sizes.response[idx].max())
        else:
            computed += len(idx) * sizes.width
    return 1.0 - real / computed if computed else 0.0
