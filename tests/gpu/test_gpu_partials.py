"""On a CUDA machine: the decode step's split-K partial products are summed unrounded, so the product
is rounded once, as the Hugging Face model's one product. Skipped without CUDA."""

import pytest
import torch
import torch.nn.functional as F

from rlcore.rollout.engine import decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("splits", [2, 4])
def test_split_products_round_once(splits):
    assert decode.probe_float32_partials(torch.device("cuda"))  # this torch computes bf16 products into float32
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(256, 4096, device="cuda", generator=g).bfloat16()
    w = torch.randn(1536, 4096, device="cuda", generator=g).div(64).bfloat16()
    whole = F.linear(x, w)
    exact = decode._sum(decode._partials(x, w, None, splits)).to(torch.bfloat16)
    rounded = decode._sum(decode._partials(x, w, None, splits, exact=False)).to(torch.bfloat16)
    off_exact = (exact != whole).float().mean().item()
    off_rounded = (rounded != whole).float().mean().item()
    assert decode._partials(x, w, None, splits).dtype == torch.float32
    assert off_exact < 0.02 and off_exact * 4 < off_rounded
