"""Grouped-query decode attention in Triton (one new token per slot, flash-decoding style).

The decode step attends each slot's ``G`` query heads of a key/value head to that head's cached
keys and values. One program handles one (slot, key/value head[, length split]): it holds the
``G`` query rows (padded to 16 rows for the tensor-core product), walks the filled columns in
blocks of ``BLOCK_N``, reads each key and value block once for all ``G`` rows, keeps a running
maximum and sum per row in float32 (online softmax) and accumulates ``P @ V``.

When there are few (slot, head) pairs for the number of multiprocessors (small batches), the
columns are cut into ``splits`` contiguous chunks and each program writes an unnormalised partial
result with its running maximum and sum; the last of a pair's programs to finish (an atomic
counter per pair, left at zero again) merges the pair's chunks, so no second kernel is launched.

Everything is read through strides (no copies), the grid and every buffer depend only on
``(n, length)``, and nothing waits for the device, so the call can be captured in a CUDA graph.
:func:`usable` says whether the kernels can run here and checks them once against PyTorch. The
device code is in :mod:`rlcore.kernels.decode_attention_kernels`; this module plans, launches and wraps it.
"""

from __future__ import annotations

import functools

import torch

from rlcore.kernels.triton_support import kernels_run_on as available  # noqa: F401 - part of this API
from rlcore.kernels.triton_support import interpreting, triton

BLOCK_N = 64
#: key/value columns per block for head dims of 128 and more (fewer registers per program)
BLOCK_N_WIDE = 32
#: split the length only when there are fewer programs than this share of the multiprocessors
#: (measured: docs/benchmarks.md, "Settings chosen by measurement")
PROGRAMS_PER_SM = 0.5
#: above this many columns (the long tail of a reasoning rollout: few rows, long contexts) a pair's
#: columns are cut until there are :data:`LONG_PROGRAMS_PER_SM` programs per multiprocessor, in
#: chunks of at least :data:`LONG_MIN_CHUNK` columns (flash-decoding)
LONG_LENGTH = 1024
LONG_PROGRAMS_PER_SM = 2.0
LONG_MIN_CHUNK = 256
MAX_SPLITS = 64
#: the most columns one program attends under the default rule, whatever the batch (None or 0: no cap). A
#: full batch is not split by the rule (enough (slot, head) pairs), so a long row's single program, sweeping
#: thousands of columns while the others sweep hundreds, is the critical path of every layer's call (rows of
#: very different lengths: the tail cut's carried samples among new ones, or a rollout's longest rows before
#: the others end); the cap cuts such rows into chunks (a short row's later chunks return at once). Per call:
#: ``attend(max_chunk=)``; per engine: ``actor.rollout_engine.attention_tuning.max_chunk``. Measured on an
#: H100 (docs/benchmarks.md, "Reasoning workload"): 1,024 made the 1.5B reasoning step's rollout 2% faster,
#: and the tail cut (with slots for its carried samples) then shorter than the defaults where it was longer
MAX_CHUNK: int | None = 1024
#: at most this many chunks for lengths up to :data:`LONG_LENGTH`
SHORT_MAX_SPLITS = 16
#: multiprocessor count assumed off CUDA (the interpreter)
DEFAULT_SMS = 8

_CHECKED: dict[tuple, tuple[bool, str]] = {}

#: Triton's contraction of a product and a sum into one fused multiply-add, off for this kernel: with it
#: on, the compiler dropped the rounding of a RoPE product to the cache dtype (a round trip through bf16
#: folded away, the product fused into the sum), so the kernel's keys and queries were not the model's,
#: bit for bit, and its log-probs further from the trainer's than HF ``generate``'s (measured on an H100;
#: Inductor turns the contraction off for the same reason under ``emulate_precision_casts``)
FP_FUSION = False

#: the precision of the value product's probabilities: None rounds them to the cache dtype first (bf16: 8
#: significant bits), as the flash attention kernels do; "tf32" (11 bits, tensor cores), "tf32x3" or "ieee"
#: (float32) keep them. A candidate for the last gap of the engine's log-probs to the trainer's (the default
#: path's 1.06-1.07x HF generate's, docs/benchmarks.md, "Current figure, numerics"), not measured yet; off by default
PV_PRECISION: str | None = None

if triton is not None:
    from rlcore.kernels.decode_attention_kernels import _attend_part  # the program (device code)


@functools.lru_cache(maxsize=None)
def _sm_count(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(index or 0).multi_processor_count


def default_block(dim: int) -> int:
    """Columns per block: :data:`BLOCK_N` for head dims under 128, else :data:`BLOCK_N_WIDE`."""
    return BLOCK_N_WIDE if dim >= 128 else BLOCK_N


def default_warps(dim: int) -> int:
    """Warps per program: 2 for head dims up to 64, else 4 (measured: docs/benchmarks.md, "Settings
    chosen by measurement")."""
    return 2 if dim <= 64 else 4


def plan(pairs: int, length: int, sms: int, splits: int | None = None, block_n: int = BLOCK_N,
         max_chunk: int | None = None) -> tuple[int, int]:
    """``(splits, chunk)``: how many chunks the ``length`` columns are cut into and their width.

    ``pairs`` is the number of (slot, key/value head) programs without splitting. By default a
    pair's columns are split only when there are fewer than :data:`PROGRAMS_PER_SM` programs per
    multiprocessor, into enough chunks to reach that (at most :data:`SHORT_MAX_SPLITS`, at least one
    ``block_n`` block each). Above :data:`LONG_LENGTH` columns (few long rows: the tail of a long
    rollout) the target is :data:`LONG_PROGRAMS_PER_SM` programs per multiprocessor, in chunks of at
    least :data:`LONG_MIN_CHUNK` columns, at most :data:`MAX_SPLITS` of them. ``max_chunk`` (default
    :data:`MAX_CHUNK`) then cuts into more chunks until none is wider (in whole blocks, so up to a block
    wider; at most :data:`MAX_SPLITS` chunks; 0: no cap). ``chunk`` is a multiple of ``block_n`` and every chunk is non-empty.
    """
    blocks = -(-length // block_n)
    if splits is None:
        long = length > LONG_LENGTH
        target = max(1, int((LONG_PROGRAMS_PER_SM if long else PROGRAMS_PER_SM) * sms))
        splits = -(-target // max(pairs, 1)) if pairs < target else 1
        splits = min(splits, max(1, length // LONG_MIN_CHUNK) if long else SHORT_MAX_SPLITS)
        cap = MAX_CHUNK if max_chunk is None else max_chunk
        if cap:
            splits = max(splits, -(-length // max(int(cap), block_n)))
    splits = max(1, min(int(splits), blocks, MAX_SPLITS))
    chunk = -(-blocks // splits) * block_n
    return -(-length // chunk), chunk


def attend(q: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor, length: int, *, splits: int | None = None,
           block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
           counters: torch.Tensor | None = None, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
           subblocks: int = 1, pages: tuple[torch.Tensor, int] | None = None,
           max_chunk: int | None = None) -> torch.Tensor:
    """Attention of one query token per slot over cache columns ``0..length-1`` (see
    :func:`rlcore.rollout.engine.decode.attend` for the shapes).

    Args:
        q: ``[n, KVH, G, D]`` queries, any strides.
        layer: ``[2, B, KVH, S, D]`` one layer's cache, rows ``0..n-1`` read, any strides.
        bias: ``[n, S]`` additive key mask (0 or ``-inf``); every row needs a valid column below ``length``.
        splits: chunks per (slot, head) along the length (default: :func:`plan`'s rule).
        block_n, num_warps, num_stages: kernel tuning (``block_n`` a power of two >= 16; defaults
            :func:`default_block` and :func:`default_warps`).
        counters: with several chunks, ``[>= n·KVH]`` int32 zeros (the last program of a (slot, head)
            to finish merges its chunks) the kernel counts in and leaves at zero,
            owned by the caller (calls that may run at the same time need their own); default: one
            buffer per device, shared.
        shared: ``(source, end)``, two ``[>= n]`` integer tensors: slot ``i`` reads its columns below
            ``end[i]`` from cache row ``source[i]`` instead of its own row (several samples of one
            prompt then read the prompt's keys and values at the same addresses, so memory serves
            them once and L2 the rest; the slot's own row need not hold them). ``None``: every slot
            reads its own row.
        subblocks: cut each block of ``block_n`` columns into this many sub-blocks with softmax
            states of their own, merged at the end (a power of two, sub-blocks of at least 16
            columns). With as many warps (``num_warps``), each warp works on its own sub-block and
            the loop needs no exchange between warps; 1 (default): one state for the block.
        pages: ``(table, page_size)`` for a paged cache: ``layer`` is ``[2, pages, KVH, page_size, D]``
            (a pool of pages) and slot ``i``'s column ``c`` is in page ``table[i, c // page_size]``
            (``table`` ``[>= n, >= ceil(length / page_size)]`` int32), row ``c % page_size``;
            ``page_size`` a multiple of ``block_n``. Excludes ``shared`` (slots share pages instead).
        max_chunk: the most columns one program attends (:func:`plan`; default :data:`MAX_CHUNK`, 0: no cap);
            ignored with ``splits``.
    Returns:
        ``[n, KVH·G·D]`` in ``q``'s dtype.

    The ``torch.library`` operator ``rlcore::attend`` (fake implementation: the result's shape) runs it
    when the call is traced (:func:`_traced`), so compiled code calls it without a graph break.
    """
    args = (q, layer, bias, length, splits, block_n, num_warps, num_stages, counters, *_flat(shared, pages),
            subblocks, _flat_cap(max_chunk))
    return attend_op(*args) if _traced(q) else _attend(*args)


def _flat(shared, pages) -> tuple:
    """``(source, end, table, page_size)`` from ``shared`` and ``pages`` (the operators' flat arguments)."""
    source, end = (None, None) if shared is None else shared
    table, page_size = (None, 0) if pages is None else pages
    return source, end, table, page_size


def _flat_cap(max_chunk: int | None) -> int:
    """``max_chunk`` as the operators' integer argument: -1 for None (:data:`MAX_CHUNK` at the call)."""
    if max_chunk is None:
        return -1
    if isinstance(max_chunk, bool) or not isinstance(max_chunk, int) or max_chunk < 0:
        raise ValueError(f"decode attention: max_chunk must be a non-negative integer (0: no cap), got {max_chunk!r}")
    return max_chunk


def _pairs(source, end, table, page_size) -> tuple:
    """``(shared, pages)`` back from :func:`_flat`'s arguments."""
    return (None if source is None and end is None else (source, end),
            None if table is None else (table, page_size))


def _traced(tensor: torch.Tensor) -> bool:
    """Whether a call is being traced: by ``torch.compile``, under a dispatch mode (fake tensors,
    ``make_fx``) or on a tensor subclass. Traced calls go through the ``torch.library`` operators; the
    others launch directly (an operator's dispatch costs tens of microseconds a call, a layer's kernel a
    few: the decode step calls one per layer)."""
    return (torch.compiler.is_compiling() or type(tensor) is not torch.Tensor
            or torch._C._len_torch_dispatch_stack() > 0)


def _attend(q: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor, length: int, splits: int | None,
            block_n: int | None, num_warps: int | None, num_stages: int | None, counters: torch.Tensor | None,
            source: torch.Tensor | None, end: torch.Tensor | None, table: torch.Tensor | None, page_size: int,
            subblocks: int, max_chunk: int = -1) -> torch.Tensor:
    shared, pages = _pairs(source, end, table, page_size)
    return _launch(q, layer, bias, length, None, splits, block_n, num_warps, num_stages, counters,
                   shared=shared, subblocks=subblocks, pages=pages, max_chunk=max_chunk)


#: :func:`attend` as a ``torch.library`` operator (flat arguments: ``shared`` and ``pages`` as
#: ``source, end, table, page_size``); the kernel counts in ``counters`` (left at zero)
attend_op = torch.library.custom_op("rlcore::attend", _attend, mutates_args=("counters",))


@attend_op.register_fake
def _(q, layer, bias, length, splits, block_n, num_warps, num_stages, counters, source, end, table, page_size,
      subblocks, max_chunk=-1):
    n, kv_heads, group, dim = q.shape
    return q.new_empty(n, kv_heads * group * dim)


def attend_new(proj: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor, length: int, cos: torch.Tensor,
               sin: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor, heads: int, kv_heads: int, *,
               splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None, counters: torch.Tensor | None = None,
               shared: tuple[torch.Tensor, torch.Tensor] | None = None,
               proj_bias: torch.Tensor | None = None, subblocks: int = 1,
               pages: tuple[torch.Tensor, int] | None = None, max_chunk: int | None = None) -> torch.Tensor:
    """The decode step's attention from the raw q/k/v projection, in one kernel: RoPE of the
    queries and the new key, the new key/value written to the cache at each slot's column, and
    attention over the columns before it (below ``length``) and the new one, taken from registers.
    Columns after a slot's new column are not read (they hold no key of its sequence yet).

    Args:
        proj: ``[n, (heads + 2·kv_heads)·D]`` the fused q/k/v projection, last dimension contiguous;
            or ``[P, n, (heads + 2·kv_heads)·D]``, ``P`` partial products (over slices of the inner
            dimension) the kernel adds up.
        layer: ``[2, B, KVH, S, D]`` one layer's cache; column ``columns[i]`` of row ``i`` is written.
        bias: ``[n, S]`` additive key mask; ``bias[i, columns[i]]`` must already be 0.
        cos, sin: ``[S, D]`` RoPE tables (``sin`` signed, see :func:`rlcore.rollout.engine.llama.signed_sin`),
            or with ``positions=None`` each slot's rows ``[n, D]`` (gathered once for all layers).
        positions, columns: ``[n]`` int64 RoPE position (or ``None``, see above) and cache column of
            each slot's new token.
        splits, block_n, num_warps, num_stages, counters, shared, subblocks, pages, max_chunk: as for :func:`attend`
            (the new key/value always goes to the slot's own row, at a column at or after its shared
            end; with ``pages``, to the page its column falls in).
        proj_bias: ``[(heads + 2·kv_heads)·D]`` added to the (summed) projection, for a ``proj``
            given without its bias.
    Returns:
        ``[n, heads·D]`` in ``layer``'s dtype (``proj`` may be float32 partial products of a bf16 model:
        their sum is rounded once, to the cache's dtype, as the model rounds its projection).

    The ``torch.library`` operator ``rlcore::attend_new`` (mutating ``layer``; fake implementation: the
    result's shape) runs it when the call is traced (:func:`_traced`).
    """
    args = (proj, layer, bias, length, cos, sin, positions, columns, heads, kv_heads, splits, block_n, num_warps,
            num_stages, counters, *_flat(shared, pages), proj_bias, subblocks, _flat_cap(max_chunk))
    return attend_new_op(*args) if _traced(proj) else _attend_new(*args)


def _attend_new(proj: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor, length: int, cos: torch.Tensor,
                sin: torch.Tensor, positions: torch.Tensor | None, columns: torch.Tensor, heads: int, kv_heads: int,
                splits: int | None, block_n: int | None, num_warps: int | None, num_stages: int | None,
                counters: torch.Tensor | None, source: torch.Tensor | None, end: torch.Tensor | None,
                table: torch.Tensor | None, page_size: int, proj_bias: torch.Tensor | None,
                subblocks: int, max_chunk: int = -1) -> torch.Tensor:
    shared, pages = _pairs(source, end, table, page_size)
    parts = proj if proj.dim() == 3 else proj[None]
    n, width = parts.shape[1], parts.shape[2]
    dim = layer.shape[-1]
    if parts.stride(-1) != 1 or width != (heads + 2 * kv_heads) * dim or cos.stride(-1) != 1 \
            or sin.stride() != cos.stride():
        raise ValueError(f"decode attention: projection {tuple(proj.shape)} does not hold {heads} + 2 x {kv_heads} "
                         f"heads of {dim}, or RoPE tables not row-major")
    if proj_bias is not None and (proj_bias.shape != (width,) or proj_bias.stride(0) != 1):
        raise ValueError(f"decode attention: proj_bias must be [{width}] and contiguous, got {tuple(proj_bias.shape)}")
    first = parts[0]
    q = first[:, :heads * dim].view(n, kv_heads, heads // kv_heads, dim)
    new = (first, first.stride(0), heads * dim, (heads + kv_heads) * dim, cos, sin, cos.stride(0),
           columns if positions is None else positions, columns)
    summed = (parts.stride(0) if parts.shape[0] > 1 else 0, proj_bias, parts.shape[0])
    return _launch(q, layer, bias, length, new, splits, block_n, num_warps, num_stages, counters,
                   rows=positions is None, shared=shared, summed=summed, subblocks=subblocks, pages=pages,
                   max_chunk=max_chunk)


#: :func:`attend_new` as a ``torch.library`` operator (flat arguments as :data:`attend_op`'s); writes
#: the new keys/values into ``layer``
attend_new_op = torch.library.custom_op("rlcore::attend_new", _attend_new, mutates_args=("layer", "counters"))


@attend_new_op.register_fake
def _(proj, layer, bias, length, cos, sin, positions, columns, heads, kv_heads, splits, block_n, num_warps,
      num_stages, counters, source, end, table, page_size, proj_bias, subblocks, max_chunk=-1):
    return proj.new_empty(proj.shape[-2], heads * layer.shape[-1], dtype=layer.dtype)


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers stay allocated: captured graphs may still use them


def _counters(device: torch.device, size: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``size`` entries, kept per device across calls: the kernel
    leaves it zeroed again, so a CUDA graph replay needs no memset. Calls on one device that pass no
    buffer of their own share it, so they must run one after another. Grows when too small."""
    buffer = _COUNTERS.get(device)
    if buffer is None or buffer.numel() < size:
        if buffer is not None:
            _RETIRED.append(buffer)
        buffer = _COUNTERS[device] = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
    return buffer


def _launch(q, layer, bias, length, new, splits, block_n, num_warps, num_stages, counters,
            rows: bool = False, shared=None, summed=(0, None, 1), subblocks: int = 1, pages=None,
            max_chunk: int = -1) -> torch.Tensor:
    n, kv_heads, group, dim = q.shape
    device = q.device
    if pages is None:
        table, page_size = q, 1
        columns, cache_rows = layer.shape[3], layer.shape[1]
    else:
        table, page_size = pages
        columns, cache_rows = table.shape[1] * page_size, table.shape[0]
        if table.dtype != torch.int32 or table.device != device or table.stride(1) != 1 \
                or layer.shape[3] != page_size or shared is not None:
            raise ValueError(f"decode attention: pages must be (an int32 table on {device} with contiguous rows, "
                             f"the cache's page size {layer.shape[3]}), without shared; got {table.dtype} on "
                             f"{table.device}, page size {page_size}, shared {shared is not None}")
    if not 0 < length <= columns or cache_rows < n or bias.shape[0] < n:
        raise ValueError(f"decode attention: length {length} outside the cache's {columns} columns, "
                         f"or fewer cache/bias rows ({cache_rows}, {bias.shape[0]}) than queries ({n})")
    out = torch.empty(n, kv_heads, group, dim, dtype=layer.dtype, device=device)  # float32 projection parts
    # (summed unrounded) still give queries, keys and an output in the cache's dtype
    width = kv_heads * group * dim
    if n == 0:
        return out.view(n, width)
    block_n = block_n or default_block(dim)
    num_warps = num_warps or default_warps(dim)
    check_subblocks(subblocks, block_n, dim)
    if pages is not None and page_size % block_n:
        raise ValueError(f"decode attention: page size {page_size} is not a multiple of the block of {block_n} columns")
    splits, chunk = plan(n * kv_heads, length, _sm_count(device.type, device.index), splits, block_n,
                         None if max_chunk < 0 else max_chunk)
    block_g = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(dim))
    keys, values = layer[0], layer[1]
    options = dict(num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    if num_stages is not None:
        options["num_stages"] = num_stages
    common = (q, *q.stride(), keys, values, *keys.stride(), bias, *bias.stride())
    sizes = (length, chunk, dim ** -0.5)
    new_args = new if new is not None else (q, 0, 0, 0, q, q, 0, q, q)
    if shared is not None:
        source, end = shared
        if source.shape[0] < n or end.shape[0] < n or source.device != device or end.device != device \
                or source.is_floating_point() or end.is_floating_point():
            raise ValueError(f"decode attention: shared (source, end) must be integer tensors of >= {n} entries "
                             f"on {device}, got {tuple(source.shape)} and {tuple(end.shape)}")
        new_args = (*new_args, source, end)
    else:
        new_args = (*new_args, q, q)
    part_stride, proj_bias, proj_parts = summed
    new_args = (*new_args, part_stride, q if proj_bias is None else proj_bias, table,
                table.stride(0) if pages is not None else 0)
    ieee = layer.dtype == torch.float32 or interpreting()
    constants = dict(group=group, dim=dim, IEEE=ieee, PV=PV_PRECISION or "", NEW=new is not None, ROWS=bool(rows),
                     PARTS=proj_parts, PBIAS=proj_bias is not None,
                     SHARED=shared is not None, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, SUB=subblocks,
                     PAGED=pages is not None, PAGE=page_size)
    if splits == 1:
        _attend_part[(n, kv_heads, 1)](*common, out, *out.stride(), out, 0, out, 0, 0, 0, 0, out, *sizes, *new_args,
                                       SPLIT=False, **constants, **options)
        return out.view(n, width)
    parts = torch.empty(n, kv_heads, splits, group, dim, dtype=torch.float32, device=device)
    stats = torch.empty(2, n, kv_heads, splits, group, dtype=torch.float32, device=device)
    plane = stats[0].numel()
    if counters is None:
        counters = _counters(device, n * kv_heads)
    elif counters.dtype != torch.int32 or counters.numel() < n * kv_heads or counters.device != device:
        raise ValueError(f"decode attention: counters must be >= {n * kv_heads} int32 on {device}, got "
                         f"{counters.numel()} {counters.dtype} on {counters.device}")
    _attend_part[(n, kv_heads, splits)](*common, parts, *parts.stride()[:2], dim, 1, stats, plane,
                                        out, *out.stride(), counters, *sizes, *new_args,
                                        SPLIT=True, **constants, **options)
    return out.view(n, width)


def gather_shared(layer: torch.Tensor, n: int, source: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """``[2, n, KVH, S, D]``: rows ``0..n-1`` of ``layer`` as the kernel reads them with
    ``shared=(source, end)`` (row ``i``'s columns below ``end[i]`` taken from row ``source[i]``)."""
    rows = layer[:, :n]
    before = torch.arange(layer.shape[3], device=layer.device)[None, :] < end[:n, None]  # [n, S]
    return torch.where(before[None, :, None, :, None], layer[:, source[:n].long()], rows)


def gather_pages(layer: torch.Tensor, table: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """``[2, n, KVH, length, D]``: the columns ``0..length-1`` of slots ``0..n-1`` of a paged layer
    (``[2, pages, KVH, page_size, D]``, slot ``i``'s column ``c`` in page ``table[i, c // page_size]``),
    laid out as a contiguous cache."""
    page_size = layer.shape[3]
    count = -(-length // page_size)
    picked = layer[:, table[:n, :count].long()]  # [2, n, count, KVH, P, D]
    two, _, _, kv_heads, _, dim = picked.shape
    return picked.transpose(2, 3).reshape(two, n, kv_heads, count * page_size, dim)[:, :, :, :length]


def paginate(layer: torch.Tensor, page_size: int,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pool, table)``: the slots of a contiguous layer ``[2, B, KVH, S, D]`` cut into pages of
    ``page_size`` columns (the last one zero-filled) scattered over a pool ``[2, 1 + B·pages, KVH,
    page_size, D]`` in a shuffled order (page 0 left empty, as the engine's null page), and the int32
    ``[B, pages]`` table that finds them (for tests and the kernel's self-check)."""
    two, slots, kv_heads, columns, dim = layer.shape
    count = -(-columns // page_size)
    padded = layer.new_zeros(two, slots, kv_heads, count * page_size, dim)
    padded[:, :, :, :columns] = layer
    order = torch.randperm(slots * count, generator=generator).add(1).view(slots, count)
    pool = layer.new_zeros(two, slots * count + 1, kv_heads, page_size, dim)
    pool[:, order.reshape(-1).to(layer.device)] = padded.view(two, slots, kv_heads, count, page_size, dim).transpose(
        2, 3).reshape(two, slots * count, kv_heads, page_size, dim)
    return pool, order.to(layer.device, torch.int32)


def reference(q: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor, length: int,
              shared: tuple[torch.Tensor, torch.Tensor] | None = None,
              pages: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """The same attention in float32 PyTorch (two matmuls and a softmax): ``[n, KVH·G·D]`` float32."""
    n, dim = q.shape[0], q.shape[-1]
    if pages is not None:
        layer = gather_pages(layer, pages[0], n, length)
    if shared is not None:
        layer = gather_shared(layer, n, *shared)
    keys, values = layer[0, :n, :, :length].float(), layer[1, :n, :, :length].float()
    scores = torch.matmul(q.float(), keys.transpose(-1, -2)) * dim ** -0.5 + bias[:, None, None, :length].float()
    return torch.matmul(torch.softmax(scores, dim=-1), values).reshape(n, -1)


def reference_new(proj: torch.Tensor, layer: torch.Tensor, bias: torch.Tensor, length: int, cos: torch.Tensor,
                  sin: torch.Tensor, positions: torch.Tensor, columns: torch.Tensor, heads: int,
                  kv_heads: int, shared: tuple[torch.Tensor, torch.Tensor] | None = None,
                  pages: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """:func:`attend_new` in PyTorch: rotates as the model does, writes the new key/value into ``layer``
    (in place) and returns :func:`reference` over it with the columns after each slot's new one
    masked, ``[n, heads·D]`` float32."""
    n, dim = proj.shape[0], layer.shape[-1]
    after = torch.arange(bias.shape[1], device=bias.device)[None, :] > columns[:, None]
    bias = bias[:n].masked_fill(after, float("-inf"))
    c, s = cos[positions].to(proj.dtype)[:, None], sin[positions].to(proj.dtype)[:, None]
    qk = proj[:, :(heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
    qk = qk * c + qk.roll(dim // 2, dims=-1) * s  # each product rounded, as the model rounds them
    rows = torch.arange(n, device=proj.device)
    at = columns
    if pages is not None:  # the page each new column falls in, and the row in it
        table, page_size = pages
        rows, at = table[rows, columns // page_size].long(), columns % page_size
    layer[0, rows, :, at] = qk[:, heads:].to(layer.dtype)
    layer[1, rows, :, at] = proj[:, (heads + kv_heads) * dim:].view(n, kv_heads, dim).to(layer.dtype)
    return reference(qk[:, :heads].reshape(n, kv_heads, heads // kv_heads, dim), layer, bias, length, shared,
                     pages)


def check_subblocks(subblocks: int, block_n: int | None, dim: int) -> None:
    """Raise ``ValueError`` unless ``subblocks`` is a power of two leaving >= 16 of ``block_n`` columns
    (default: :func:`default_block` of head dim ``dim``) to each sub-block (the products' least width)."""
    block_n = block_n or default_block(dim)
    if subblocks < 1 or subblocks & (subblocks - 1) or block_n // subblocks < 16:
        raise ValueError(f"decode attention: subblocks must be a power of two that leaves >= 16 of the block's "
                         f"{block_n} columns to each sub-block, got {subblocks}")


def usable(device: torch.device | str, dtype: torch.dtype, kv_heads: int, group: int,
           head_dim: int, settings: dict | None = None, page_size: int | None = None) -> tuple[bool, str]:
    """``(ok, reason)``: whether the kernels run on ``device`` and agree with :func:`reference`
    on a small random input of this head layout, whole and split, with the kernel ``settings``
    (``block_n``, ``num_warps``, ``num_stages``, ``subblocks``; checked once per layout and settings)
    and, given ``page_size``, also over a paged cache of pages of that many columns."""
    device = torch.device(device)
    settings = dict(settings or {})
    if page_size is not None:
        settings["page_size"] = int(page_size)
    if triton is None:
        return False, "triton is not installed"
    if not available(device):
        return False, f"device {device} is not CUDA"
    key = (str(device), dtype, kv_heads, group, head_dim, tuple(sorted(settings.items())))
    if key not in _CHECKED:
        _CHECKED[key] = _self_check(device, dtype, kv_heads, group, head_dim, settings)
    return _CHECKED[key]


def _self_check(device: torch.device, dtype: torch.dtype, kv_heads: int, group: int,
                head_dim: int, settings: dict) -> tuple[bool, str]:
    settings = dict(settings)
    page_size = settings.pop("page_size", None)
    gen = torch.Generator().manual_seed(0)
    n, slots, columns, length = 3, 4, 2 * BLOCK_N + 8, BLOCK_N + 24
    layer = torch.randn(2, slots, kv_heads, columns, head_dim, generator=gen).to(device, dtype)
    q = torch.randn(n, kv_heads, group, head_dim, generator=gen).to(device, dtype)
    bias = torch.zeros(n, columns)
    bias[0, 5:40] = float("-inf")
    bias[1, length - 30:] = float("-inf")
    bias = bias.to(device, dtype)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    heads = kv_heads * group
    proj = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    cos, sin = torch.randn(2, columns, head_dim, generator=gen).to(device)
    positions = torch.tensor([3, 70, 11], device=device)
    at = torch.tensor([length - 1, 9, length - 20], device=device)
    try:
        expected = reference(q, layer, bias, length)
        for splits in (1, 2):
            got = attend(q, layer, bias, length, splits=splits, **settings).float()
            if not torch.allclose(got, expected, atol=tolerance, rtol=tolerance):
                error = float((got - expected).abs().max())
                return False, f"disagrees with PyTorch attention (splits {splits}, max abs error {error:.3g})"
        # slots 1 and 2 read their first columns from row 0 (as samples of one prompt do); then the
        # same cache cut into pages scattered over a pool
        sharing = (torch.tensor([0, 0, 0], device=device), torch.tensor([0, 9, 40], device=device))
        cases = [(splits, shared, layer, bias, None) for shared in (None, sharing) for splits in (1, 2)]
        if page_size is not None:
            pool, table = paginate(layer, page_size, gen)
            wide = torch.full((n, table.shape[1] * page_size), float("-inf"), dtype=dtype, device=device)
            wide[:, :columns] = bias
            cases += [(splits, None, pool, wide, (table, page_size)) for splits in (1, 2)]
        for splits, shared, cache, mask, pages in cases:
            expected_cache = cache.clone()
            expected = reference_new(proj, expected_cache, mask, length, cos, sin, positions, at, heads, kv_heads,
                                     shared, pages)
            got_cache = cache.clone()
            got = attend_new(proj, got_cache, mask, length, cos, sin, positions, at, heads, kv_heads,
                             splits=splits, shared=shared, pages=pages, **settings).float()
            error = float((got - expected).abs().max())
            written = float((got_cache.float() - expected_cache.float()).abs().max())
            if error > tolerance * 3 or written > tolerance * 3:
                return False, (f"RoPE-and-write attention disagrees with PyTorch (splits {splits}, shared prompt "
                               f"{shared is not None}, pages {pages is not None}, max abs error {error:.3g}, "
                               f"cache {written:.3g})")
    except Exception as error:  # noqa: BLE001 - any failure means: use the PyTorch path
        return False, f"{type(error).__name__}: {str(error)[:300]}"
    return True, "ok"
