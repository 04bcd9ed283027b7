"""Training forwards without padding: sequence packing and token-budget micro-batches.

A micro-batch of ``B`` samples arrives padded (left-padded prompts, right-padded responses,
``[B, T]``). Packed, its real tokens are concatenated into one row ``[1, L]`` (``L`` = the sum of
the sequence lengths) with ``position_ids`` restarting at 0 at each sequence. Attention must then
stay inside each sequence; Hugging Face models do this from the positions when no 2-D attention
mask is given:

- ``sdpa`` / ``eager`` / ``flex_attention``: ``create_causal_mask`` finds the sequences where
  the positions do not step by one and ANDs the causal mask with a block-diagonal one;
- ``flash_attention_*``: the variable-length kernel is called with ``cu_seqlens``; we pass
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` ourselves (no guessing from the positions).

Only the logits that predict a response token are computed (``logits_to_keep`` given as the
positions), so the packed forward also skips the prompt positions' vocabulary projection. The
packed row is filled up to a multiple of :data:`PACK_MULTIPLE` tokens with a sequence of its own
(token 0, positions from 0, no logits), so that compiled layers see one alignment of the row's
length and do not recompile for another; and never to a length 64 past a multiple of 128, where the
cuDNN attention backward fails under a mask (:mod:`rlcore.trainer.aligned`).
:func:`rlcore.trainer.packing_check.packing_isolates` checks on the real model that packed sequences
do not see each other; ``ppo.pack_sequences=auto`` packs only where it passes and the attention is variable-length
(flash or flex): with ``sdpa``/``eager`` the packed row's mask is dense, so a packed forward costs
``L^2`` attention instead of the sum of the sequences' squares (``true`` packs there too).

Token budgets: :func:`token_groups` cuts an ordered list of samples into micro-batches of at
most ``max_tokens`` tokens (real tokens when packed, rows x padded width otherwise).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from rlcore.trainer import aligned
from rlcore.trainer.aligned import safe_masked_width

log = logging.getLogger(__name__)

#: packed rows are filled up to a multiple of this many tokens (compiled kernels specialise on a
#: length's alignment: one alignment, one compilation)
PACK_MULTIPLE = 8


@dataclass
class PackedRows:
    """One micro-batch packed into a single row (see the module docstring).

    ``input_ids``/``position_ids`` ``[1, L]``; ``index [K]``: the packed positions whose logits predict
    the ``K`` response tokens ``labels [K]``, which sit at ``(rows[k], cols[k])`` of the ``[B, R]``
    response layout; ``cu_seqlens [n + 1]`` (int32) and ``max_len``: the sequence boundaries.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    labels: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    cu_seqlens: torch.Tensor
    max_len: int
    shape: tuple[int, int]

    def unpack(self, values: torch.Tensor) -> torch.Tensor:
        """``values [K]`` (one per response token) -> ``[B, R]``, 0 elsewhere; keeps the autograd graph."""
        out = values.new_zeros(self.shape)
        return out.index_put((self.rows, self.cols), values)

    def forward_kwargs(self, model: torch.nn.Module) -> dict:
        """Keyword arguments of the model's forward for the packed row (no attention mask)."""
        kw = dict(input_ids=self.input_ids, position_ids=self.position_ids, attention_mask=None)
        if "flash" in attention_implementation(model):
            kw.update(cu_seq_lens_q=self.cu_seqlens, cu_seq_lens_k=self.cu_seqlens,
                      max_length_q=self.max_len, max_length_k=self.max_len)
        return kw


def attention_implementation(model: torch.nn.Module) -> str:
    """The Hugging Face attention implementation of ``model`` ('' when it has none)."""
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", "") or "")


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
         multiple_of: int = PACK_MULTIPLE) -> PackedRows:
    """Pack ``B`` padded sequences ``[B, T]`` whose last ``R`` columns are the response (``response_mask [B, R]``).

    When the real tokens do not fill a multiple of ``multiple_of``, a filler sequence (token 0,
    positions from 0) ends the row: its own entry in ``cu_seqlens``, no logits, so it changes
    nothing the real sequences compute.

    A row's real tokens (``attention_mask``) must be contiguous (left-padded prompt, then the
    response, then right padding); every response token must follow at least one token of its
    own sequence (prompts are not empty).
    """
    keep = attention_mask.bool()
    batch, width = keep.shape
    response_len = response_mask.shape[1]
    prompt_cols = width - response_len
    lengths = keep.sum(-1)
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)
    flat = keep.reshape(-1).long().cumsum(0).view(batch, width) - 1  # packed position of each real token
    resp = response_mask.bool() & keep[:, prompt_cols:]
    rows, cols = resp.nonzero(as_tuple=True)
    index = flat[:, prompt_cols:][rows, cols] - 1
    labels = input_ids[:, prompt_cols:][rows, cols]
    used = lengths[lengths > 0]
    ids, pos = input_ids[keep], positions[keep]
    step = max(1, int(multiple_of))
    fill = safe_masked_width(ids.numel() + (-ids.numel() % step), step) - ids.numel()
    if fill:
        ids = torch.cat([ids, ids.new_zeros(fill)])
        pos = torch.cat([pos, torch.arange(fill, dtype=pos.dtype, device=pos.device)])
        used = torch.cat([used, used.new_full((1,), fill)])
    cu = torch.zeros(len(used) + 1, dtype=torch.int32, device=input_ids.device)
    cu[1:] = used.cumsum(0)
    return PackedRows(input_ids=ids[None], position_ids=pos[None], index=index,
                      labels=labels, rows=rows, cols=cols, cu_seqlens=cu,
                      max_len=int(used.max()) if len(used) else 0, shape=(batch, response_len))


# ---------------------------------------------------------------------------------------------
# Token-budget micro-batches
# ---------------------------------------------------------------------------------------------


def sequence_lengths(attention_mask: torch.Tensor, response_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """``(prompt tokens, response tokens)`` of each sample, as host lists (one copy each)."""
    response_len = response_mask.shape[1]
    total = attention_mask.sum(-1)
    resp = attention_mask[:, attention_mask.shape[1] - response_len:].sum(-1)
    return (total - resp).cpu().tolist(), resp.cpu().tolist()


def group_cost(prompt: Sequence[int], response: Sequence[int], packed: bool) -> int:
    """Tokens one forward over these samples processes: their sum packed, else rows x padded width (the
    longest sample when the rows are moved left, :mod:`rlcore.trainer.aligned`; else the longest prompt
    plus the longest response)."""
    if packed:
        return int(sum(prompt) + sum(response))
    if aligned.ENABLED:
        return len(prompt) * max((p + r for p, r in zip(prompt, response)), default=0)
    return len(prompt) * (max(prompt, default=0) + max(response, default=0))


#: padded (not packed) micro-batches are cut where the padding saved outweighs one more micro-batch,
#: counted as this many tokens of compute (its fixed cost: the host's launches and reads, about 50 ms,
#: against ~25 us a token for a 1.5B model's forward and backward on an H100); off: filled greedily to
#: the budget
LEAST_PADDING = True
MICRO_BATCH_COST_TOKENS = 2048
#: the most samples :func:`least_padding_groups` puts in one micro-batch (bounds its search; a budget
#: holds that many only for very short samples)
MAX_GROUP_ROWS = 1024


def token_groups(prompt: Sequence[int], response: Sequence[int], max_tokens: int, packed: bool) -> list[list[int]]:
    """Cut samples ``0..n-1`` (in this order) into consecutive micro-batches of at most ``max_tokens``
    tokens each (:func:`group_cost`). A sample longer than the budget is a micro-batch of its own.

    Packed, each micro-batch is filled up to the budget (no padding: the fewest micro-batches cost
    least). Padded, the cut that computes the fewest tokens (padding included) plus
    :data:`MICRO_BATCH_COST_TOKENS` per micro-batch (:func:`least_padding_groups`): a micro-batch
    filled to the budget would pad its shorter samples to its longest."""
    if not packed and LEAST_PADDING and len(prompt) > 1:
        return least_padding_groups(prompt, response, max_tokens)
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in range(len(prompt)):
        trial = cur + [i]
        if cur and group_cost([prompt[j] for j in trial], [response[j] for j in trial], packed) > max_tokens:
            groups.append(cur)
            cur = [i]
        else:
            cur = trial
    if cur:
        groups.append(cur)
    return groups


def least_padding_groups(prompt: Sequence[int], response: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Consecutive micro-batches of samples ``0..n-1``, each within ``max_tokens`` by
    :func:`group_cost` (a sample over it alone), minimising the tokens computed plus
    :data:`MICRO_BATCH_COST_TOKENS` per micro-batch (dynamic programming over the cut points)."""
    n, rows_left = len(prompt), aligned.ENABLED
    best = [0.0] + [float("inf")] * n  # best[i]: the cheapest cut of samples 0..i-1
    cut = [0] * (n + 1)
    for i in range(1, n + 1):
        longest = top_prompt = top_response = 0
        for j in range(i - 1, -1, -1):  # the last micro-batch is samples j..i-1 (group_cost, kept up to date)
            longest = max(longest, prompt[j] + response[j])
            top_prompt, top_response = max(top_prompt, prompt[j]), max(top_response, response[j])
            tokens = (i - j) * (longest if rows_left else top_prompt + top_response)
            if (tokens > max_tokens and j < i - 1) or i - j > MAX_GROUP_ROWS:
                break
            total = best[j] + tokens + MICRO_BATCH_COST_TOKENS
            if total < best[i]:
                best[i], cut[i] = total, j
    groups: list[list[int]] = []
    i = n
    while i > 0:
        groups.append(list(range(cut[i], i)))
        i = cut[i]
    return groups[::-1]


def split_to(groups: list[list[int]], count: int, prompt: Sequence[int], response: Sequence[int],
             packed: bool) -> list[list[int]]:
    """Split the costliest groups in halves until there are ``count`` (at most one per sample)."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [k for k, g in enumerate(groups) if len(g) > 1]
        if not splittable:
            break
        k = max(splittable, key=lambda k: group_cost([prompt[j] for j in groups[k]],
                                                      [response[j] for j in groups[k]], packed))
        g = groups[k]
        groups[k:k + 1] = [g[:len(g) // 2], g[len(g) // 2:]]
    return groups


def agreed_count(count: int) -> int:
    """The largest ``count`` over the ranks of the default process group (``count`` without one).

    Sharded models gather their weights in every forward, so all ranks must run as many."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return count
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor([count], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def micro_batches(attention_mask: torch.Tensor, response_mask: torch.Tensor, order: torch.Tensor, micro: int,
                  max_tokens: int, packed: bool) -> list[torch.Tensor]:
    """Indices of the micro-batches of the samples ``order`` (in that order): ``micro`` samples each,
    or, with ``max_tokens > 0``, token-budget groups (:func:`token_groups`), as many on every rank."""
    order = order.cpu()
    if max_tokens <= 0:
        return list(torch.split(order, max(1, micro)))
    prompt, response = sequence_lengths(attention_mask[order.to(attention_mask.device)],
                                        response_mask[order.to(response_mask.device)])
    groups = token_groups(prompt, response, max_tokens, packed)
    groups = split_to(groups, agreed_count(len(groups)), prompt, response, packed)
    return [order[torch.tensor(g, dtype=torch.long)] for g in groups]
