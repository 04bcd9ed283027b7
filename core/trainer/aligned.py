"""Training forwards without an attention mask: each row's tokens moved to its first column.

A micro-batch arrives as ``[B, T]`` rows with left-padded prompts and right-padded responses.
Given to the model with its 2-D attention mask, every attention call gets a dense ``[T, T]``
mask: the kernels cannot skip the causal upper triangle, and the rows of left padding attend to
nothing at all (fully masked rows). Moved left, so that each row's real tokens start at column 0
and its padding follows them, a row needs no mask: under the causal rule a real token attends only
to the tokens before it, all real; the padding at the end of a row attends to the row's tokens and
is never read. The forward then runs with ``attention_mask=None`` and positions ``0..L-1``, which
Hugging Face models turn into the attention kernels' own causal path (``is_causal``; no mask
tensor, no fully masked rows) — with the same positions and the same tokens for every real token.

One reason beyond speed: the cuDNN attention backward of PyTorch 2.11 (the default SDPA backend on
H100/H200) returns NaN gradients when a mask is passed and the length is 64 past a multiple of
128 (pytorch/pytorch#196678): a trimmed micro-batch of such a width made every gradient of the
step NaN. Without a mask the kernel is not in that case. Forwards that still pass a mask (rows
whose tokens have holes, packed rows under ``sdpa``) keep their width off that remainder
(:func:`safe_masked_width`).

:func:`align_left` gives the moved rows and where each response token's prediction sits in them.

Given position ids and no mask, a Hugging Face model first checks whether its rows are several
sequences packed into one (``transformers.masking_utils.find_packed_sequence_indices``); the check
reads the device (``.all()`` of a device tensor), so the host waits there for every queued kernel
before each forward, and whatever it does next (cuDNN builds an execution plan for each new
attention shape) runs while the device has nothing queued. Moved rows are never packed: their
positions are ``0..L-1`` by construction. :func:`rows_not_packed` answers the check for the
forwards it wraps without reading the device (elsewhere, and in other threads, the check runs as it
always does).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

#: move rows left and drop the mask in the training forwards (off: the rows as they come, with their
#: mask; for side-by-side benchmarks and probes)
ENABLED = True

#: aligned rows are widened to a multiple of this many columns (compiled layers see one alignment of
#: the length, as trimmed rows do: :data:`rlcore.trainer.experience.TRIM_MULTIPLE`)
ALIGN_MULTIPLE = 8


@dataclass
class AlignedRows:
    """``[B, T]`` rows moved left into ``[B, L]`` (see the module docstring).

    ``input_ids``/``position_ids`` ``[B, L]``; ``shift [B]``: the columns each row moved left by (its
    left padding); ``lengths [B]``: its real tokens; ``width``: ``T`` of the rows it came from.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift: torch.Tensor
    lengths: torch.Tensor
    width: int

    def forward_kwargs(self) -> dict:
        """Keyword arguments of the model's forward: no attention mask."""
        return dict(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=None)

    def response_positions(self, response_len: int) -> torch.Tensor:
        """``[B, R]``: the aligned column whose output predicts each of the last ``response_len``
        columns of the original rows (clamped into the row where that column is padding)."""
        cols = torch.arange(response_len, device=self.shift.device)
        pos = (self.width - response_len - 1) - self.shift[:, None] + cols[None]
        return pos.clamp(0, self.input_ids.shape[1] - 1)


class KnownRows(NamedTuple):
    """What the host already knows of a micro-batch's rows (from the sizes it read once an update), so
    that its forward reads nothing of the device: ``longest``, the longest row's tokens, where every row's
    tokens are known to be contiguous (else ``None``), and ``trained``, the response tokens it trains."""

    longest: Optional[int]
    trained: int


def align_left(input_ids: torch.Tensor, attention_mask: torch.Tensor,
               multiple_of: int = ALIGN_MULTIPLE, longest: Optional[int] = None) -> Optional[AlignedRows]:
    """The rows moved left, or ``None`` when some row's real tokens are not contiguous (a hole in its
    mask: it needs the mask) or some row has none. ``longest``: the caller knows the rows are contiguous
    and their longest (:class:`KnownRows`): no read of the device."""
    keep = attention_mask.bool()
    batch, width = keep.shape
    if batch == 0 or width == 0:
        return None
    lengths = keep.sum(-1)
    first = keep.int().argmax(-1)
    if longest is None:
        last = width - 1 - keep.flip(-1).int().argmax(-1)
        contiguous = (last - first + 1 == lengths) & (lengths > 0)
        ok, longest = torch.stack([contiguous.all().long(), lengths.max()]).tolist()  # one host sync
        if not ok:
            return None
    step = max(1, int(multiple_of))
    cols = -(-int(longest) // step) * step
    arange = torch.arange(cols, device=input_ids.device)
    src = (first[:, None] + arange[None]).clamp(max=width - 1)
    ids = torch.where(arange[None] < lengths[:, None], input_ids.gather(1, src), torch.zeros_like(src))
    return AlignedRows(input_ids=ids.to(input_ids.dtype), position_ids=arange[None].expand(batch, -1),
                       shift=first, lengths=lengths, width=width)


_STATE = threading.local()


def _install_check() -> bool:
    """Wrap Hugging Face's packed-sequence check (once) so that it answers "not packed" without reading the
    device while :func:`rows_not_packed` is active in the calling thread; False where the library has none."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        return False
    if getattr(original, "_rlcore_rows_not_packed", False):
        return True

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        if getattr(_STATE, "depth", 0):
            return None
        return find_packed_sequence_indices.__wrapped__(position_ids, *args, **kwargs)

    find_packed_sequence_indices.__wrapped__ = original
    find_packed_sequence_indices.__doc__ = original.__doc__
    find_packed_sequence_indices._rlcore_rows_not_packed = True
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    return True


@contextlib.contextmanager
def rows_not_packed():
    """Within the block, this thread's model forwards take their rows as unpacked without reading the
    device (the module docstring): for forwards of :func:`align_left`'s rows, whose positions are
    ``0..L-1`` in every row."""
    _install_check()
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


#: lengths ``L`` with ``L % 128 == 64`` make the cuDNN SDPA backward NaN under a mask (module docstring)
_BAD_MODULUS, _BAD_REMAINDER = 128, 64


def safe_masked_width(width: int, multiple_of: int = 8) -> int:
    """The smallest width ``>= width`` (in steps of ``multiple_of``) not ``64`` past a multiple of ``128``."""
    step = max(1, int(multiple_of))
    while width % _BAD_MODULUS == _BAD_REMAINDER:
        width += step
    return width
