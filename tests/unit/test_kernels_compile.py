"""Every Triton kernel of the project compiles for a Hopper GPU (sm_90: PTX, then a cubin through the
``ptxas`` Triton ships), without a GPU: a kernel change that does not compile fails here, not only
on a CUDA machine. Runs where Triton is installed; the kernels' results are tested elsewhere."""

from __future__ import annotations

import pytest

from rlcore.kernels.triton_support import compile_for_hopper, interpreting, triton

pytestmark = pytest.mark.skipif(triton is None or interpreting(),
                                reason="needs Triton (not its interpreter)")

# argument types by name, per kernel family; names not listed are 32-bit integers (sizes, strides)
ATTENTION = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "bias_ptr": "*bf16", "new_ptr": "*bf16",
             "pbias_ptr": "*bf16", "out_ptr": "*bf16", "final_ptr": "*bf16", "stat_ptr": "*fp32",
             "cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "col_ptr": "*i64", "src_ptr": "*i32",
             "end_ptr": "*i32", "count_ptr": "*i32", "part_ptr": "*fp32", "scale": "fp32", "table_ptr": "*i32"}
STEP = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "col_ptr": "*i64", "bias_ptr": "*bf16",
        "cos_out": "*fp32", "sin_out": "*fp32", "col_out": "*i64", "tok_ptr": "*i64", "lp_ptr": "*fp32",
        "next_ptr": "*i64", "out_tok_ptr": "*i64", "out_lp_ptr": "*fp32", "done_ptr": "*i1", "eos_ptr": "*i64"}
SAMPLING = {"logits_ptr": "*bf16", "inv_temp": "fp32", "max_ptr": "*fp32", "sum_ptr": "*fp32", "key_ptr": "*fp32",
            "idx_ptr": "*i32", "tokens_ptr": "*i64", "logprobs_ptr": "*fp32", "uniforms_ptr": "*fp32"}
LOGPROB = {"logits_ptr": "*bf16", "labels_ptr": "*i64", "inv_temp": "fp32", "logp_ptr": "*fp32",
           "lse_ptr": "*fp32", "ent_ptr": "*fp32", "grad_out_ptr": "*fp32", "grad_ptr": "*bf16"}

ATTEND_NEW = dict(group=7, dim=64, IEEE=False, PV="", NEW=True, ROWS=True, SHARED=True, PARTS=2, PBIAS=True,
                  BLOCK_G=16, BLOCK_D=64, BLOCK_N=64, SUB=1, PAGED=False, PAGE=1)
PAGED = dict(ATTEND_NEW, SHARED=False, PAGED=True, PAGE=64)
CASES = {
    # the engine's decode step: RoPE, q/k/v slices and bias, shared prompt rows; one program per pair
    "attend_new": ("rlcore.kernels.decode_attention", "_attend_part", ATTENTION,
                   dict(ATTEND_NEW, SPLIT=False), 2),
    # each warp on a sub-block of 16 columns with a softmax state of its own (a batched product)
    "attend_new_subblocks": ("rlcore.kernels.decode_attention", "_attend_part", ATTENTION,
                             dict(ATTEND_NEW, SPLIT=False, SUB=4), 4),
    # small batches: chunks merged by the pair's last program
    "attend_new_split": ("rlcore.kernels.decode_attention", "_attend_part",
                         dict(ATTENTION, out_ptr="*fp32"), dict(ATTEND_NEW, SPLIT=True), 2),
    # the paged cache: keys/values found through the block table (a 7B shape: head dim 128, blocks of 32)
    "attend_new_paged": ("rlcore.kernels.decode_attention", "_attend_part", ATTENTION,
                         dict(PAGED, SPLIT=False, dim=128, BLOCK_D=128, BLOCK_N=32), 4),
    # the long tail: few rows, the columns cut into chunks merged by the pair's last program
    "attend_new_paged_split": ("rlcore.kernels.decode_attention", "_attend_part",
                               dict(ATTENTION, out_ptr="*fp32"), dict(PAGED, SPLIT=True), 2),
    # plain attention of given queries, float32 products, chunks merged by the pair's last program
    "attend_fp32": ("rlcore.kernels.decode_attention", "_attend_part",
                    {k: v.replace("bf16", "fp32") for k, v in ATTENTION.items()} | {"out_ptr": "*fp32"},
                    dict(ATTEND_NEW, NEW=False, ROWS=False, SHARED=False, PARTS=1, PBIAS=False, IEEE=True,
                         SPLIT=True, dim=128, BLOCK_D=128, BLOCK_N=32), 4),
    "begin_step": ("rlcore.kernels.step_kernels", "_begin_step", STEP, dict(BLOCK_N=32, BLOCK_D=64), 4),
    "record": ("rlcore.kernels.step_kernels", "_record", STEP, dict(BLOCK_N=128, BLOCK_E=2), 4),
    "partial_rows": ("rlcore.kernels.fused_sampling", "_partial_rows", SAMPLING,
                     dict(GREEDY=False, FAST=True, BLOCK=1024), 8),
    "merge_rows": ("rlcore.kernels.fused_sampling", "_merge_rows", SAMPLING, dict(SPLITS=16), 1),
    "chunk_stats": ("rlcore.kernels.fused_sampling", "_chunk_stats", SAMPLING, dict(CHUNK=2048), 4),
    "draw_rows": ("rlcore.kernels.fused_sampling", "_draw_rows", SAMPLING, dict(SPLITS=128, CHUNK=2048, KEYED=False), 4),
    "draw_rows_keyed": ("rlcore.kernels.fused_sampling", "_draw_rows", SAMPLING,
                        dict(SPLITS=128, CHUNK=2048, KEYED=True), 4),
    "logprob_forward": ("rlcore.kernels.logprob", "_forward_rows", LOGPROB,
                        dict(WITH_ENTROPY=True, BLOCK=4096), 8),
    "logprob_backward": ("rlcore.kernels.logprob", "_backward_rows", LOGPROB, dict(BLOCK=4096), 8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_compiles_for_hopper(case):
    from importlib import import_module

    module, name, types, constants, warps = CASES[case]
    kernel = getattr(import_module(module), name)
    unknown = set(constants) - set(kernel.arg_names)
    assert not unknown, f"{name} has no arguments {unknown}"  # the table above is out of date
    compiled = compile_for_hopper(kernel, types, constants, warps)
    assert len(compiled.asm["cubin"]) > 1000 and ".entry" in compiled.asm["ptx"]


def test_the_attention_kernel_keeps_the_models_roundings_no_fused_multiply_add():
    """The decode-attention kernel is compiled as the engine launches it, without Triton's contraction of
    products and sums: with it, the compiler folded a RoPE product's round trip through bf16 away and fused
    the product into the sum (on an H100 the kernel's keys then differed from the model's in 1-2 bf16 units
    in the last place). No ``fma`` in the PTX with the engine's setting; the default setting has them."""
    from rlcore.kernels import decode_attention

    kernel = decode_attention._attend_part
    constants = dict(ATTEND_NEW, SPLIT=False)
    engine = compile_for_hopper(kernel, ATTENTION, constants, 2, fp_fusion=decode_attention.FP_FUSION)
    assert decode_attention.FP_FUSION is False
    assert "fma.rn.f32" not in engine.asm["ptx"]
    fused = compile_for_hopper(kernel, ATTENTION, constants, 2, fp_fusion=True)
    assert "fma.rn.f32" in fused.asm["ptx"]


def test_the_value_product_rounds_its_probabilities_unless_told_otherwise():
    """By default (``PV_PRECISION`` None) the probabilities are rounded to bf16 and the value product runs on
    bf16 tensor-core inputs, as the flash kernels do; with "tf32" they stay float32 and the product runs on
    TF32 inputs (a precision between, for the numerics comparison)."""
    from rlcore.kernels import decode_attention

    kernel = decode_attention._attend_part
    assert decode_attention.PV_PRECISION is None
    plain = compile_for_hopper(kernel, ATTENTION, dict(ATTEND_NEW, SPLIT=False), 4, fp_fusion=False).asm["ptx"]
    wide = compile_for_hopper(kernel, ATTENTION, dict(ATTEND_NEW, SPLIT=False, PV="tf32"), 4,
                              fp_fusion=False).asm["ptx"]
    assert ".tf32" not in plain and ".bf16" in plain
    assert ".tf32" in wide

