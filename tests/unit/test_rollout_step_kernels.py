"""The decode step's bookkeeping kernels against the PyTorch code they replace."""

from __future__ import annotations

import pytest
import torch

from rlcore.kernels import step_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernel = pytest.mark.skipif(not step_kernels.available(DEVICE),
                                  reason="needs Triton and CUDA or TRITON_INTERPRET=1")


@needs_kernel
def test_begin_step_matches_pytorch():
    gen = torch.Generator().manual_seed(0)
    slots, columns_total, dim, last = 6, 20, 16, 19
    cos, sin = (torch.randn(columns_total, dim, generator=gen).to(DEVICE) for _ in range(2))
    positions = torch.tensor([0, 5, 19, 7, 3, 11], device=DEVICE)
    columns = torch.tensor([2, 9, 19, 0, 4, 12], device=DEVICE)
    bias = torch.full((slots, columns_total), float("-inf"), device=DEVICE)
    n = 4  # the last two slots are not in this step: nothing of theirs changes
    state = [positions.clone(), columns.clone(), bias.clone()]
    expected = step_kernels.begin_step_reference(cos, sin, state[0][:n], state[1][:n], state[2], last)
    got_state = [positions.clone(), columns.clone(), bias.clone()]
    got = step_kernels.begin_step(cos, sin, got_state[0][:n], got_state[1][:n], got_state[2], last)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    for a, b in zip(got_state, state):
        assert torch.equal(a, b)
    assert int(got_state[1][2]) == last and int(got_state[0][2]) == last  # clamped at the cache's end
    assert torch.equal(got_state[0][n:], positions[n:]) and torch.equal(got_state[2][n:], bias[n:])


@needs_kernel
@pytest.mark.parametrize("eos", [[], [7], [3, 7, 11]])
def test_record_matches_pytorch(eos):
    cap, width = 6, 4
    tokens = torch.tensor([7, 1, 3, 11, 2], device=DEVICE)
    logprobs = torch.tensor([-0.5, -1.0, -2.0, -0.1, -3.0], device=DEVICE)
    eos_t = torch.tensor(eos, dtype=torch.long, device=DEVICE)

    def buffers():
        return [torch.zeros(cap, dtype=torch.long, device=DEVICE), torch.full((cap, width), -1, device=DEVICE),
                torch.zeros(cap, width, device=DEVICE), torch.tensor([0, 1, 3, 4, 2, 0], device=DEVICE),
                torch.tensor([False, True, False, False, False, False], device=DEVICE)]

    expected, got = buffers(), buffers()
    step_kernels.record_reference(tokens, logprobs, *expected, eos_t)
    step_kernels.record(tokens, logprobs, *got, eos_t)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
    assert bool(got[4][1])  # a finished flag stays set
    assert int(got[3][3]) == 5 and int(got[1][3, width - 1]) == 11  # past the last column: written at the last


def test_step_and_sampling_kernels_are_custom_ops_with_fake_implementations():
    """The engine's step kernels and the fused sampler are ``torch.library`` operators: under fake
    tensors (what the compiler traces with) they give the shapes and dtypes of their results and run no
    kernel, so compiled code can call them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlcore.kernels import fused_sampling, step_kernels

    with FakeTensorMode():
        cos = torch.empty(16, 8)
        positions, columns = torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long)
        rows, _, now = torch.ops.rlcore.begin_step(cos, cos, positions, columns, torch.zeros(4, 16), 15)
        tokens, logprobs = torch.ops.rlcore.sample_rows(torch.empty(5, 100), 0.7, 1)
        torch.ops.rlcore.record(tokens, logprobs, torch.zeros(5, dtype=torch.long), torch.zeros(5, 4, dtype=torch.long),
                                torch.zeros(5, 4), torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.bool),
                                torch.empty(0, dtype=torch.long))
    assert rows.shape == (3, 8) and now.shape == (3,) and now.dtype == torch.long
    assert tokens.shape == (5,) and tokens.dtype == torch.long and logprobs.dtype == torch.float32
    assert step_kernels.begin_step is not None and fused_sampling.sample_rows is not None
