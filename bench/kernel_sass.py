"""Static look at the decode-attention kernel as the engine compiles it for an H100/H200 (sm_90),
without a GPU: registers, spill stack, shared memory, SASS instructions in all, and in the column
loop's body the instructions, barriers and shared-memory accesses of one iteration.

The kernel is specialised as the engine launches it (RoPE rows, q/k/v in two slices plus bias,
shared prompt rows, one program per slot and key/value head), for each kernel setting given:

    python bench/kernel_sass.py --settings '[{}, {"subblocks": 4, "num_warps": 4}]'

A setting ``{"page_size": 64}`` compiles the paged-cache form instead (keys and values found through
the block table, no shared prompt rows).

Uses the ``nvdisasm`` and ``cuobjdump`` that Triton ships. Counts depend on the Triton version
(printed); they say where a program's instructions go, not how fast it runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import import_rlcore, write_json  # noqa: E402

import_rlcore()

from rlcore.kernels import decode_attention  # noqa: E402
from rlcore.kernels.triton_support import compile_for_hopper, triton  # noqa: E402

#: (query heads, key/value heads, head dim)
SHAPES = {"qwen2-0.5b": (14, 2, 64), "qwen2-1.5b": (12, 2, 128)}
TYPES = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bias_ptr": "*bf16", "new_ptr": "*bf16",
         "pbias_ptr": "*bf16", "out_ptr": "*bf16", "final_ptr": "*bf16", "stat_ptr": "*fp32", "count_ptr": "*i32",
         "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "col_ptr": "*i64", "src_ptr": "*i32",
         "end_ptr": "*i32", "scale": "fp32", "table_ptr": "*i32"}
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")
LABEL = re.compile(r"\s*(\.L_x_\d+):")


def engine_values(heads: int, kv_heads: int, dim: int, batch: int, columns: int,
                  page_size: int | None = None) -> dict[str, int]:
    """The integer arguments of the engine's call (strides of its buffers; with ``page_size``, of a
    page and of the block table)."""
    width, group = (heads + 2 * kv_heads) * dim, heads // kv_heads
    rows = page_size or columns
    return dict(sq_n=width, sq_h=group * dim, sq_g=dim, sq_d=1, sc_b=kv_heads * rows * dim, sc_h=rows * dim,
                sc_s=dim, sc_d=1, sb_n=columns, sb_s=1, so_n=heads * dim, so_h=group * dim, so_g=dim, so_d=1,
                sn_n=width, k_off=heads * dim, v_off=(heads + kv_heads) * dim, s_rope=dim,
                part_stride=batch * width, length=257, chunk=320, st_b=-(-columns // rows))


def tools() -> tuple[str, str]:
    where = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.join(where, "nvdisasm"), os.path.join(where, "cuobjdump")


def sass_stats(cubin: bytes) -> dict:
    """Registers, stack and instruction counts of a cubin, and those of its longest loop body."""
    nvdisasm, cuobjdump = tools()
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        text = subprocess.run([nvdisasm, "-c", handle.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", handle.name], capture_output=True, text=True).stdout
    code, labels, pending = [], {}, []
    for line in text.splitlines():
        label = LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        found = INSTRUCTION.match(line)
        if found:
            for name in pending:
                labels[name] = len(code)
            pending = []
            code.append((found.group(2), found.group(3)))
    loops = []
    for index, (op, operands) in enumerate(code):
        target = re.search(r"(\.L_x_\d+)", operands) if op.startswith("BRA") else None
        if target and labels.get(target.group(1), index) < index:
            loops.append(code[labels[target.group(1)]:index + 1])
    body = max(loops, key=len, default=[])
    ops = collections.Counter(op.split(".")[0] for op, _ in body)
    registers = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    return {"registers": int(registers.group(1)) if registers else None,
            "stack_bytes": int(stack.group(1)) if stack else None, "instructions": len(code),
            "loop_instructions": len(body), "loop_barriers": ops["BAR"], "loop_shared_loads": ops["LDS"],
            "loop_shared_stores": ops["STS"], "loop_mma": ops["HMMA"], "loop_async_copies": ops["LDGSTS"]}


def compile_setting(shape: str, setting: dict, batch: int, columns: int) -> dict:
    heads, kv_heads, dim = SHAPES[shape]
    block_n = setting.get("block_n") or decode_attention.default_block(dim)
    subblocks = setting.get("subblocks", 1)
    decode_attention.check_subblocks(subblocks, block_n, dim)
    group = heads // kv_heads
    page_size = setting.get("page_size")
    constants = dict(group=group, dim=dim, IEEE=False, PV="", NEW=True, ROWS=True, SHARED=page_size is None, PARTS=2,
                     PBIAS=True, SPLIT=False, FOLD=False, BLOCK_G=max(16, triton.next_power_of_2(group)),
                     BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_N=block_n, SUB=subblocks,
                     PAGED=page_size is not None, PAGE=page_size or 1)
    warps = setting.get("num_warps") or decode_attention.default_warps(dim)
    compiled = compile_for_hopper(decode_attention._attend_part, TYPES, constants, warps, setting.get("num_stages"),
                                  engine_values(heads, kv_heads, dim, batch, columns, page_size),
                                  fp_fusion=decode_attention.FP_FUSION)
    return {"setting": setting, "shared_bytes": compiled.metadata.shared, **sass_stats(compiled.asm["cubin"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-0.5b")
    parser.add_argument("--settings", default="[{}]", help='a JSON list of kernel settings, e.g. '
                        '\'[{}, {"subblocks": 4, "num_warps": 4}]\'')
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--columns", type=int, default=448, help="cache columns a slot (the cache's strides)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if triton is None:
        parser.error("needs Triton")
    rows = [compile_setting(args.shape, setting, args.batch, args.columns) for setting in json.loads(args.settings)]
    print(f"decode attention, {args.shape}, sm_90, Triton {triton.__version__}")
    print(f"{'setting':<58} {'regs':>4} {'stack':>5} {'smem':>6} {'instr':>5} | loop: {'instr':>5} {'bar':>3} "
          f"{'lds':>3} {'sts':>3} {'mma':>3}")
    for row in rows:
        print(f"{json.dumps(row['setting']):<58} {row['registers']:>4} {row['stack_bytes']:>5} "
              f"{row['shared_bytes']:>6} {row['instructions']:>5} | loop: {row['loop_instructions']:>5} "
              f"{row['loop_barriers']:>3} {row['loop_shared_loads']:>3} {row['loop_shared_stores']:>3} "
              f"{row['loop_mma']:>3}")
    write_json(args.out, {"triton": triton.__version__, "shape": args.shape, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
