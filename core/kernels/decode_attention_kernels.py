"""The Triton device code of :mod:`rlcore.kernels.decode_attention`: the per-(slot, head[, chunk]) program
:func:`_attend_part` and the functions it inlines (the new token's projection and RoPE, the online softmax
over blocks of cache columns, the merge of a pair's chunks by its last program). The launch, the plan of
chunks, the ``torch.library`` operators and the PyTorch references are in that module, which launches
:func:`_attend_part`.
"""

from __future__ import annotations

from rlcore.kernels.triton_support import tl, triton

if triton is not None:
    _NEG = tl.constexpr(-3.0e38)  # finite start of the running maximum: no inf - inf on empty blocks

    @triton.jit
    def _proj(ptrs, bias_ptrs, ok, part_stride, PARTS: tl.constexpr, PBIAS: tl.constexpr):
        """float32 projection values at ``ptrs``: the sum of ``PARTS`` partial products (``part_stride``
        elements apart), plus the bias at ``bias_ptrs`` (``PBIAS``)."""
        value = tl.load(ptrs, mask=ok, other=0.0).to(tl.float32)
        for p in tl.static_range(1, PARTS):
            value += tl.load(ptrs + p * part_stride, mask=ok, other=0.0).to(tl.float32)
        if PBIAS:
            value += tl.load(bias_ptrs, mask=ok, other=0.0).to(tl.float32)
        return value

    @triton.jit
    def _rotate_new(q_rows, q_cols, sq_d, row_ok, row_new, new_cols, k_off, v_off, cos_ptr, sin_ptr, rope_at,
                    feats, feat_ok, part_stride, pbias_ptr, out_dtype: tl.constexpr, dim: tl.constexpr,
                    PARTS: tl.constexpr, PBIAS: tl.constexpr):
        """RoPE (half-split layout: ``x * cos + roll(x, D/2) * signed sin``) of the query rows
        (pointers ``q_rows``, projection columns ``q_cols``) and of the new key in the projection row
        ``row_new`` (its head's columns start at ``new_cols``); returns ``(rotated q in ``out_dtype``,
        rotated key float32, value float32)``. The projection values are read through :func:`_proj`.

        Rounded to ``out_dtype`` where the Hugging Face model rounds (its values are what the
        trainer recomputes): the projections (the value's too), the cos/sin rows, each of the two
        products and their sum (:func:`_round` is a no-op in float32)."""
        turned = (feats + dim // 2) % dim
        cos = _round(tl.load(cos_ptr + rope_at + feats, mask=feat_ok, other=0.0).to(tl.float32), out_dtype)
        sin = _round(tl.load(sin_ptr + rope_at + feats, mask=feat_ok, other=0.0).to(tl.float32), out_dtype)
        q_ok = row_ok[:, None] & feat_ok[None, :]
        q = _round(_proj(q_rows + feats[None, :] * sq_d, pbias_ptr + q_cols + feats[None, :], q_ok, part_stride,
                         PARTS, PBIAS), out_dtype)
        q_turned = _round(_proj(q_rows + turned[None, :] * sq_d, pbias_ptr + q_cols + turned[None, :], q_ok,
                                part_stride, PARTS, PBIAS), out_dtype)
        q = (_round(q * cos[None, :], out_dtype) + _round(q_turned * sin[None, :], out_dtype)).to(out_dtype)
        key = _round(_proj(row_new + k_off + feats, pbias_ptr + new_cols + k_off + feats, feat_ok, part_stride,
                           PARTS, PBIAS), out_dtype)
        key_turned = _round(_proj(row_new + k_off + turned, pbias_ptr + new_cols + k_off + turned, feat_ok,
                                  part_stride, PARTS, PBIAS), out_dtype)
        # the value too: it enters this column's softmax term from registers, not from the cache
        value = _round(_proj(row_new + v_off + feats, pbias_ptr + new_cols + v_off + feats, feat_ok, part_stride,
                             PARTS, PBIAS), out_dtype)
        return q, _round(key * cos, out_dtype) + _round(key_turned * sin, out_dtype), value

    @triton.jit
    def _round(x, dtype: tl.constexpr):
        """``x`` (float32) rounded to ``dtype`` and back."""
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _fold_block(q, k, v, bias, run_max, run_sum, acc, scale, IEEE: tl.constexpr, SUB: tl.constexpr,
                    PV: tl.constexpr):
        """Fold one block of keys/values (additive ``bias``, ``-inf`` on the columns outside the
        range) into the online softmax: returns the new running maximum, sum and output accumulator.
        With ``SUB`` > 1 every tensor has a leading sub-block dimension (a batch of products). ``PV``
        (without ``IEEE``): "" rounds the probabilities to the values' dtype for their product, else
        they stay float32 and the product runs at that ``input_precision``
        (:data:`rlcore.kernels.decode_attention.PV_PRECISION`)."""
        if SUB == 1:
            k = tl.trans(k)
        else:
            k = tl.permute(k, (0, 2, 1))
        if IEEE:
            scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        scores = scores * scale + tl.expand_dims(bias, -2)
        new_max = tl.maximum(run_max, tl.max(scores, axis=-1))
        p = tl.exp(scores - tl.expand_dims(new_max, -1))
        alpha = tl.exp(run_max - new_max)
        run_sum = run_sum * alpha + tl.sum(p, axis=-1)
        if IEEE:
            acc = acc * tl.expand_dims(alpha, -1) + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        elif PV == "":
            acc = acc * tl.expand_dims(alpha, -1) + tl.dot(p.to(v.dtype), v)
        else:
            acc = acc * tl.expand_dims(alpha, -1) + tl.dot(p, v.to(tl.float32), input_precision=PV)
        return new_max, run_sum, acc

    @triton.jit
    def _fold_columns(q, k_base, v_base, bias_base, sb_s, sc_s, lo, hi, feat_ok, run_max, run_sum, acc, scale,
                      shared_end, shared_shift, table_row, sc_p, new_col, new_key, new_value, IEEE: tl.constexpr,
                      BLOCK_N: tl.constexpr, SUB: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
                      NEW: tl.constexpr, PV: tl.constexpr):
        """Fold cache columns ``lo..hi-1`` (keys/values at ``k_base``/``v_base`` + column x
        ``sc_s``, plus ``shared_shift`` for the columns below ``shared_end``) into the online
        softmax, ``BLOCK_N`` at a time, in one pipelined loop.

        ``NEW``: column ``new_col`` takes its key/value from registers (``new_key``, ``new_value``, in
        the cache's dtype: the step's own, being written to the cache by another program) in place of
        what the cache holds there, so the new column is folded within its block, with the same
        running maximum as its neighbours, as the trainer's attention folds it (not apart, after the
        other columns: that rounds the probabilities of the value product against another maximum).

        ``PAGED``: the columns live in pages of ``PAGE`` columns (a multiple of ``BLOCK_N``, so a
        block never straddles two pages): column ``c`` is at page ``table_row[c // PAGE]`` (``sc_p``
        elements a page), row ``c % PAGE``; one table entry is loaded a block.

        ``SUB`` > 1 cuts each block into ``SUB`` sub-blocks of contiguous columns, each with a
        softmax state of its own (a leading batch dimension: with as many warps, each warp owns a
        sub-block, so the loop's row reductions and the probabilities' trip to the second product
        stay within a warp); the states are merged after the loop."""
        if SUB == 1:
            cols = tl.arange(0, BLOCK_N)
        else:
            cols = tl.arange(0, SUB)[:, None] * (BLOCK_N // SUB) + tl.arange(0, BLOCK_N // SUB)[None, :]
            first = tl.arange(0, SUB) == 0  # the state so far enters in sub-block 0
            q = tl.broadcast_to(q[None, :, :], (SUB, q.shape[0], q.shape[1]))
            run_max = tl.where(first[:, None], run_max[None, :], _NEG)
            run_sum = tl.where(first[:, None], run_sum[None, :], 0.0)
            acc = tl.where(first[:, None, None], acc[None, :, :], 0.0)
        # the page of the loop's next block is loaded an iteration ahead (one dependent load less per block)
        if PAGED:
            page = tl.load(table_row + lo // PAGE, mask=lo < hi, other=0).to(tl.int64)
        for start in range(lo, hi, BLOCK_N):
            col = start + cols
            col_ok = col < hi
            if PAGED:
                at = tl.expand_dims(page * sc_p + (start % PAGE + cols).to(tl.int64) * sc_s, -1)
                page = tl.load(table_row + (start + BLOCK_N) // PAGE, mask=start + BLOCK_N < hi, other=0).to(tl.int64)
            else:
                # the row shift times a 0/1 flag, not a select: through a select Triton 3.9 loses the
                # addresses' alignment and neither vectorises nor pipelines these loads
                at = tl.expand_dims(col.to(tl.int64) * sc_s + shared_shift * (col < shared_end).to(tl.int64), -1)
            tile_ok = tl.expand_dims(col_ok, -1) & feat_ok
            k = tl.load(k_base + at, mask=tile_ok, other=0.0)
            v = tl.load(v_base + at, mask=tile_ok, other=0.0)
            if NEW:
                here = tl.expand_dims(col == new_col, -1)
                k = tl.where(here, new_key, k)
                v = tl.where(here, new_value, v)
            bias = tl.load(bias_base + col * sb_s, mask=col_ok, other=float("-inf")).to(tl.float32)
            run_max, run_sum, acc = _fold_block(q, k, v, bias, run_max, run_sum, acc, scale, IEEE, SUB, PV)
        if SUB > 1:
            top = tl.max(run_max, axis=0)
            weight = tl.exp(run_max - top[None, :])
            run_sum = tl.sum(run_sum * weight, axis=0)
            acc = tl.sum(acc * weight[:, :, None], axis=0)
            run_max = top
        return run_max, run_sum, acc

    @triton.jit
    def _attend_part(q_ptr, sq_n, sq_h, sq_g, sq_d,
                     k_ptr, v_ptr, sc_b, sc_h, sc_s, sc_d,
                     bias_ptr, sb_n, sb_s,
                     out_ptr, so_n, so_h, so_g, so_d,
                     stat_ptr, stat_plane,
                     final_ptr, sf_n, sf_h, sf_g, sf_d, count_ptr,
                     length, chunk, scale,
                     new_ptr, sn_n, k_off, v_off, cos_ptr, sin_ptr, s_rope, pos_ptr, col_ptr,
                     src_ptr, end_ptr, part_stride, pbias_ptr, table_ptr, st_b,
                     group: tl.constexpr, dim: tl.constexpr,
                     SPLIT: tl.constexpr,  # cut into chunks; the pair's last program to finish merges them
                     IEEE: tl.constexpr,  # float32 products, no TF32
                     PV: tl.constexpr,  # the value product's precision ("": probabilities in the cache dtype)
                     NEW: tl.constexpr,  # q is the raw projection: rotate it, write the new key/value
                     ROWS: tl.constexpr,  # NEW with RoPE rows per slot (cos_ptr, sin_ptr [n, D]), not tables
                     SHARED: tl.constexpr,  # columns < end_ptr[slot] are read from cache row src_ptr[slot]
                     PARTS: tl.constexpr,  # NEW: the projection is the sum of PARTS partial products
                     PBIAS: tl.constexpr,  # NEW: plus the projection bias pbias_ptr
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                     SUB: tl.constexpr,  # sub-blocks of a block with softmax states of their own
                     PAGED: tl.constexpr,  # the cache is a pool of pages: sc_b is a page's stride, and
                     PAGE: tl.constexpr):  # slot's column c is in page table_ptr[slot, c // PAGE], row c % PAGE
        # group and dim are compile-time constants so that, with dim a power of two, the feature
        # masks fold away and the key/value rows load as full vectors
        slot = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1).to(tl.int64)
        part = tl.program_id(2)
        rows = tl.arange(0, BLOCK_G)
        feats = tl.arange(0, BLOCK_D)
        row_ok = rows < group
        feat_ok = feats < dim
        if not NEW:
            q = tl.load(q_ptr + slot * sq_n + head * sq_h + rows[:, None] * sq_g + feats[None, :] * sq_d,
                        mask=row_ok[:, None] & feat_ok[None, :], other=0.0)
        if PAGED:
            own = tl.zeros_like(slot)  # the page (from the slot's table row) gives the address
        else:
            own = slot * sc_b
        k_base = k_ptr + own + head * sc_h + feats[None, :] * sc_d
        v_base = v_ptr + own + head * sc_h + feats[None, :] * sc_d
        table_row = table_ptr + slot * st_b
        bias_base = bias_ptr + slot * sb_n
        run_max = tl.full([BLOCK_G], _NEG, tl.float32)
        run_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        lo = part * chunk
        hi = tl.minimum(lo + chunk, length)
        shared_end = 0
        shared_shift = tl.zeros_like(slot)
        if SHARED:
            # the columns before the slot's shared end are read from the slot that holds the
            # prompt's keys/values (the same addresses for every slot of a prompt: read from
            # memory once, then from L2); the rest from the slot's own row; one loop for both (loaded
            # first: the cache stores below would keep the compiler from issuing them earlier)
            shared_end = tl.load(end_ptr + slot)
            shared_shift = (tl.load(src_ptr + slot).to(tl.int64) - slot) * sc_b
        new_col = -1
        if NEW:
            # rotate the G query rows and the new key; the new key/value go to the cache at the
            # slot's column (part 0) and enter the softmax from registers in the block of the
            # program whose columns hold it
            new_col = tl.load(col_ptr + slot)
            if ROWS:
                rope_at = slot * s_rope
            else:
                rope_at = tl.load(pos_ptr + slot) * s_rope
            q_cols = head * sq_h + rows[:, None] * sq_g
            q, key, value = _rotate_new(q_ptr + slot * sq_n + q_cols, q_cols, sq_d, row_ok,
                                        new_ptr + slot * sn_n + head * dim, head * dim, k_off, v_off,
                                        cos_ptr, sin_ptr, rope_at, feats, feat_ok, part_stride, pbias_ptr,
                                        k_ptr.dtype.element_ty, dim, PARTS, PBIAS)
            key = key.to(k_ptr.dtype.element_ty)
            if part == 0:
                if PAGED:
                    new_page = tl.load(table_row + new_col // PAGE).to(tl.int64)
                    at = new_page * sc_b + (new_col % PAGE).to(tl.int64) * sc_s + feats * sc_d
                else:
                    at = slot * sc_b + new_col.to(tl.int64) * sc_s + feats * sc_d
                tl.store(k_ptr + head * sc_h + at, key, mask=feat_ok)
                tl.store(v_ptr + head * sc_h + at, value.to(v_ptr.dtype.element_ty), mask=feat_ok)
            value = value.to(v_ptr.dtype.element_ty)
            # columns after the new one hold no key of this slot yet: not read at all
            hi = tl.minimum(hi, new_col + 1)
        else:
            key = tl.zeros([BLOCK_D], k_ptr.dtype.element_ty)
            value = key
        run_max, run_sum, acc = _fold_columns(q, k_base, v_base, bias_base, sb_s, sc_s, lo, hi, feat_ok,
                                              run_max, run_sum, acc, scale, shared_end, shared_shift, table_row, sc_b,
                                              new_col, key, value, IEEE, BLOCK_N, SUB, PAGED, PAGE, NEW, PV)
        _store_result(acc, run_max, run_sum, out_ptr, slot * so_n + head * so_h, so_g, so_d, stat_ptr, stat_plane,
                      final_ptr + slot * sf_n + head * sf_h, sf_g, sf_d, count_ptr, slot * tl.num_programs(1) + head,
                      part, rows, feats, group, dim, SPLIT, BLOCK_G, BLOCK_D)

    @triton.jit
    def _store_result(acc, run_max, run_sum, out_ptr, out_off, so_g, so_d, stat_ptr, stat_plane, final_ptr, sf_g, sf_d,
                      count_ptr, pair, part, rows, feats, group: tl.constexpr, dim: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """A program's result: the normalised output rows at ``out_ptr + out_off`` (the pair's rows), or with
        ``SPLIT`` the chunk's unnormalised partial and its running maximum and sum (merged by the
        pair's last program to finish)."""
        row_ok = rows < group
        out_ok = row_ok[:, None] & (feats < dim)[None, :]
        out_at = out_ptr + out_off + rows[:, None] * so_g + feats[None, :] * so_d
        if SPLIT:
            out_at = out_at + part * group * dim  # partials are [n, KVH, splits, G, D] float32
            stat_at = stat_ptr + (pair * tl.num_programs(2) + part) * group + rows
            tl.store(out_at, acc, mask=out_ok)
            tl.store(stat_at, run_max, mask=row_ok)
            tl.store(stat_at + stat_plane, run_sum, mask=row_ok)
            _merge_if_last(count_ptr, pair, out_ptr, stat_ptr, stat_plane, final_ptr, sf_g, sf_d, rows, feats,
                           group, dim, BLOCK_G, BLOCK_D)
        else:
            tl.store(out_at, (acc / run_sum[:, None]).to(out_ptr.dtype.element_ty), mask=out_ok)

    @triton.jit
    def _merge_pair(part_ptr, stat_ptr, stat_plane, pair, splits, out_at, rows, feats,
                    group: tl.constexpr, dim: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """Merge the ``splits`` partial results of one (slot, head) pair and store the output at
        ``out_at`` (loads through L2: other programs may have written the partials just now)."""
        ok = (rows < group)[:, None] & (feats < dim)[None, :]
        run_max = tl.full([BLOCK_G], _NEG, tl.float32)
        run_sum = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for part in range(0, splits):
            index = pair * splits + part
            stat_at = stat_ptr + index * group + rows
            part_max = tl.load(stat_at, mask=rows < group, other=_NEG, cache_modifier=".cg")
            # padded rows: no 0 / 0
            part_sum = tl.load(stat_at + stat_plane, mask=rows < group, other=1.0, cache_modifier=".cg")
            part_acc = tl.load(part_ptr + index * group * dim + rows[:, None] * dim + feats[None, :],
                               mask=ok, other=0.0, cache_modifier=".cg")
            new_max = tl.maximum(run_max, part_max)
            old = tl.exp(run_max - new_max)
            new = tl.exp(part_max - new_max)
            run_sum = run_sum * old + part_sum * new
            acc = acc * old[:, None] + part_acc * new[:, None]
            run_max = new_max
        tl.store(out_at, (acc / run_sum[:, None]).to(out_at.dtype.element_ty), mask=ok)

    @triton.jit
    def _merge_if_last(count_ptr, pair, part_ptr, stat_ptr, stat_plane, final_ptr, sf_g, sf_d, rows, feats,
                       group: tl.constexpr, dim: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
        """After a program stored its chunk's partial result: count it in the pair's counter and,
        if it is the pair's last chunk to arrive, merge the pair's chunks into ``final_ptr`` (the
        pair's output rows) and reset the counter to zero for the next call."""
        tl.debug_barrier()  # every thread's stores before one thread's release
        ticket = tl.atomic_add(count_ptr + pair, 1, sem="acq_rel")
        if ticket == tl.num_programs(2) - 1:
            final_at = final_ptr + rows[:, None] * sf_g + feats[None, :] * sf_d
            _merge_pair(part_ptr, stat_ptr, stat_plane, pair, tl.num_programs(2), final_at, rows, feats,
                        group, dim, BLOCK_G, BLOCK_D)
            tl.atomic_xchg(count_ptr + pair, 0)
