"""Probe: the decode step's layer in other kernel arrangements, timed against the engine's step.

Forms (all at one batch, the mean context's attention length, CUDA-graph replays; the numbers of the
forms other than ``engine`` are timings only, their outputs are not the model's):

* ``engine``: the engine's own step (compiled pieces, split-K o/down, Triton attention);
* ``fold_inplace``: RMSNorm weights folded into the q/k/v and gate/up matrices, the norm's row
  scale applied by the consumers (attention; a SiLU·mul kernel that also reduces the row), the
  o and down products added to the residual in place by the library (beta = 1): 6 kernels a layer;
* ``fold_split_down``: the same with the down product cut in 4 slices and one kernel adding them to
  the residual (and computing the next norm's row scale): 7 kernels a layer;
* ``fold_split_down_qkv2``: the same with the q/k/v product in 2 slices (the attention reading one);
* ``fold_split_down_qkv2_gate_up_t``: the same with the gate/up product transposed (weight x input^T,
  the SiLU·mul kernel and the down product reading the transposed layout);
* ``engine_cublaslt``: the engine's step with PyTorch's preferred BLAS library set to cuBLASLt.

    python bench/probes/probe_layer_forms.py --shape qwen2-0.5b --batch 256
"""

from __future__ import annotations

import argparse
import sys

import torch

sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.dirname(__import__("os").path.abspath(__file__))))
from _common import environment, graph_ms, import_rlcore, write_json  # noqa: E402
from bench_rollout import build  # noqa: E402

import_rlcore()

from rlcore.kernels import decode_attention  # noqa: E402
from rlcore.kernels.triton_support import tl, triton  # noqa: E402


@triton.jit
def _silu_rows(gu_ptr, x_ptr, out_ptr, inter, hidden, eps, BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    x = tl.load(x_ptr + row * hidden + h, mask=h < hidden, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    cols = tl.arange(0, BLOCK)
    for start in range(0, inter, BLOCK):
        at = start + cols
        ok = at < inter
        g = tl.load(gu_ptr + row * 2 * inter + at, mask=ok, other=0.0).to(tl.float32) * rstd
        u = tl.load(gu_ptr + row * 2 * inter + inter + at, mask=ok, other=0.0).to(tl.float32) * rstd
        tl.store(out_ptr + row * inter + at, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_cols(gu_ptr, rstd_ptr, out_ptr, inter, n, BF: tl.constexpr, BS: tl.constexpr):
    """The transposed form: ``gu [2·inter, n]`` (features x slots), row scales ``rstd [n]``."""
    f = tl.program_id(0) * BF + tl.arange(0, BF)
    s = tl.program_id(1) * BS + tl.arange(0, BS)
    ok = (f < inter)[:, None] & (s < n)[None, :]
    at = f.to(tl.int64)[:, None] * n + s[None, :]
    r = tl.load(rstd_ptr + s, mask=s < n, other=0.0)[None, :]
    g = tl.load(gu_ptr + at, mask=ok, other=0.0).to(tl.float32) * r
    u = tl.load(gu_ptr + inter * n + at, mask=ok, other=0.0).to(tl.float32) * r
    tl.store(out_ptr + at, (g * tl.sigmoid(g) * u).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _add_parts(x_ptr, parts_ptr, rstd_ptr, n, hidden, eps, PARTS: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    ok = h < hidden
    x = tl.load(x_ptr + row * hidden + h, mask=ok, other=0.0).to(tl.float32)
    for p in tl.static_range(PARTS):
        x += tl.load(parts_ptr + (p * n + row) * hidden + h, mask=ok, other=0.0).to(tl.float32)
    x = x.to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * hidden + h, x, mask=ok)
    xf = x.to(tl.float32)
    tl.store(rstd_ptr + row, tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps))


def reset_state(engine, n: int, length: int) -> None:
    """Every slot at column ``length - 1``, 8 samples a prompt sharing its first 128 columns."""
    st, dev = engine.state, engine.device
    st.positions.fill_(length - 1)
    st.cache_index.fill_(length - 1)
    st.bias.zero_()
    st.share_active = True
    st.share_source.copy_(torch.arange(n, device=dev, dtype=torch.int32) // 8 * 8)
    st.share_end.fill_(128)
    st.tokens.random_(10, engine.spec.vocab_size)


def folded_steps(engine, n: int, length: int):
    """``step(split_down, qkv_split, transposed=False)``: one decode step in the folded forms (see the
    module docstring), on the engine's weights, cache and state."""
    spec, st, w, dev = engine.spec, engine.state, engine.weights, engine.device
    heads, kv_heads, eps, hidden = spec.num_heads, spec.num_kv_heads, spec.rms_eps, spec.hidden_size
    inter = w.layers[0].gate_up[0].shape[0] // 2
    folded = [(lw.qkv[0] * lw.ln1[None], lw.qkv_bias[0], lw.o, lw.gate_up[0] * lw.ln2[None], lw.down)
              for lw in w.layers]
    x_buf = torch.empty(n, hidden, device=dev, dtype=torch.bfloat16)
    act = torch.empty(n, inter, device=dev, dtype=torch.bfloat16)
    parts = torch.empty(4, n, hidden, device=dev, dtype=torch.bfloat16)
    rstd = torch.ones(n, device=dev, dtype=torch.float32)
    block_h = triton.next_power_of_2(hidden)

    def mlp(gate_up, down, split_down: bool, transposed: bool) -> None:
        width = inter // 4
        if transposed:  # act holds act^T [inter, n]; the down product reads it through strides
            gu_t = torch.mm(gate_up, x_buf.t())
            _silu_cols[(triton.cdiv(inter, 64), triton.cdiv(n, 64))](gu_t, rstd, act, inter, n, BF=64, BS=64,
                                                                      num_warps=4)
            torch.bmm(act.view(4, width, n).transpose(1, 2), down.view(-1, 4, width).permute(1, 2, 0), out=parts)
        else:
            gu = torch.mm(x_buf, gate_up.t())
            _silu_rows[(n,)](gu, x_buf, act, inter, hidden, eps, BLOCK_H=block_h, BLOCK=1024, num_warps=4)
            if not split_down:
                x_buf.addmm_(act, down.t())
                return
            torch.bmm(act.view(n, 4, width).transpose(0, 1), down.view(-1, 4, width).permute(1, 2, 0), out=parts)
        _add_parts[(n,)](x_buf, parts, rstd, n, hidden, eps, PARTS=4, BLOCK_H=block_h, num_warps=4)

    def step(split_down: bool, qkv_split: int, transposed: bool = False):
        positions, columns = st.positions[:n], st.cache_index[:n]
        cos, sin = engine.cos.index_select(0, positions), engine.sin.index_select(0, positions)
        torch.index_select(w.embed, 0, st.tokens[:n], out=x_buf)
        for index, (qkv, qkv_bias, o, gate_up, down) in enumerate(folded):
            if qkv_split > 1:
                width = hidden // qkv_split
                proj = torch.bmm(x_buf.view(n, qkv_split, width).transpose(0, 1),
                                 qkv.view(-1, qkv_split, width).permute(1, 2, 0))[0]
            else:
                proj = torch.mm(x_buf, qkv.t())
            attn = decode_attention.attend_new(proj, engine.cache[index], st.bias[:n], length, cos, sin, None, columns,
                                               heads, kv_heads, counters=st.attention_counters,
                                               shared=(st.share_source[:n], st.share_end[:n]))
            x_buf.addmm_(attn, o.t())
            mlp(gate_up, down, split_down, transposed)
        return torch.nn.functional.linear(torch.nn.functional.rms_norm(x_buf, (hidden,), w.norm, eps), w.lm_head)

    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen2-0.5b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from rlcore.rollout.engine import RolloutEngine

    n, length = args.batch, args.length
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = build(args.shape, dev).eval()
    engine = RolloutEngine(model, max_batch_size=n, max_seq_len=384, attention="triton", share_weights=False,
                           kv_cache="static")
    folded_step = folded_steps(engine, n, length)
    results = {"env": environment(), "command": " ".join(sys.argv), "shape": args.shape, "batch": n,
               "length": length, "forms": {}}
    forms = {
        "engine": lambda: engine._step(n, length, engine._fns),
        "fold_inplace": lambda: folded_step(False, 1),
        "fold_split_down": lambda: folded_step(True, 1),
        "fold_split_down_qkv2": lambda: folded_step(True, 2),
        "fold_split_down_qkv2_gate_up_t": lambda: folded_step(True, 2, True),
        "engine_cublaslt": lambda: engine._step(n, length, engine._fns),
    }
    default_blas = torch.backends.cuda.preferred_blas_library() if dev == "cuda" else None
    results["default_blas"] = str(default_blas)
    for rounds in range(2):
        for name, fn in forms.items():
            reset_state(engine, n, length)
            if dev == "cuda":
                torch.backends.cuda.preferred_blas_library("cublaslt" if name == "engine_cublaslt" else default_blas)
            ms = graph_ms(fn, repeats=30) if dev == "cuda" else (fn(), 0.0)[1]
            results["forms"].setdefault(name, []).append(ms)
            print(f"  {args.shape} batch {n} length {length} {name:24s} {ms:.4f} ms", flush=True)
    write_json(args.out, results)
    return 0

if __name__ == "__main__":
    sys.exit(main())
