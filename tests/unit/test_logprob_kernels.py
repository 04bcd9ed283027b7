"""The one-pass log-prob / entropy kernels against PyTorch, run through Triton's interpreter on
CPU when Triton is installed (``TRITON_INTERPRET=1``), or on CUDA."""

from __future__ import annotations

import pytest
import torch

from rlcore.kernels import logprob as logprob_kernels
from rlcore.trainer import models

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_kernels = pytest.mark.skipif(not logprob_kernels.available(DEVICE),
                                   reason="needs Triton and CUDA or TRITON_INTERPRET=1")


def reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    z = logits.float() / temperature
    logp_all = torch.log_softmax(z, -1)
    logp = logp_all.gather(-1, labels[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@needs_kernels
@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 1.0), (torch.float32, 0.7), (torch.bfloat16, 1.3)])
def test_forward_backward_match_torch(dtype, temperature):
    gen = torch.Generator().manual_seed(0)
    vocab = 2 * logprob_kernels.BLOCK + 123  # a ragged last block
    full = (torch.randn(3, 6, vocab, generator=gen) * 4).to(DEVICE, dtype)
    full[1, 2, 17] = 60.0  # one dominant logit
    logits = full[:, 1:-1].detach().requires_grad_(False)  # a strided slice, as the model's response logits
    labels = torch.randint(0, vocab, (3, 4), generator=gen).to(DEVICE)
    labels[0, 0] = vocab - 1
    logp, lse, ent = logprob_kernels.forward(logits, labels, temperature, with_entropy=True)
    want_logp, want_ent = reference(logits, labels, temperature)
    tol = 1e-4 if dtype == torch.float32 else 1e-3
    assert torch.allclose(logp, want_logp, atol=tol, rtol=tol)
    assert torch.allclose(ent, want_ent, atol=tol, rtol=tol)
    assert torch.allclose(lse, torch.logsumexp(logits.float() / temperature, -1), atol=tol, rtol=tol)

    upstream = torch.randn(3, 4, generator=gen).to(DEVICE)
    grad = logprob_kernels.backward(logits, labels, temperature, lse, upstream)
    leaf = logits.float().requires_grad_(True)
    (reference(leaf, labels, temperature)[0] * upstream).sum().backward()
    assert grad.dtype == dtype and grad.shape == logits.shape
    if dtype == torch.float32:
        assert torch.allclose(grad, leaf.grad, atol=1e-5)
    else:  # the gradient is rounded to bfloat16
        assert torch.allclose(grad.float(), leaf.grad, atol=1e-3, rtol=1e-2)


@needs_kernels
def test_fast_path_agrees_with_the_reference():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 3000, generator=gen).to(DEVICE).requires_grad_(True)
    labels = torch.randint(0, 3000, (2, 5), generator=gen).to(DEVICE)
    upstream = torch.randn(2, 5, generator=gen).to(DEVICE)
    results = {}
    for kernels in (True, False):
        models.LOGPROB_KERNELS = kernels
        try:
            logits.grad = None
            logp, ent = models.token_logprobs(logits, labels, 0.9, True)
            (logp * upstream).sum().backward()
            results[kernels] = (logp.detach(), ent, logits.grad.clone())
        finally:
            models.LOGPROB_KERNELS = True
    for a, b in zip(results[True], results[False]):
        assert torch.allclose(a, b, atol=1e-5)


@needs_kernels
def test_fast_path_is_a_custom_op_the_compiler_traces():
    """The kernels are ``torch.library`` operators with fake implementations: a compiled function calls
    them in one graph (no graph break) and gets the eager results and gradients."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 4, 700, generator=gen).to(DEVICE)
    labels = torch.randint(0, 700, (2, 4), generator=gen).to(DEVICE)
    torch.library.opcheck(torch.ops.rlcore.logprob_forward.default, (logits, labels, 0.8, True),
                          test_utils=("test_schema", "test_faketensor"))

    def loss(x):
        logp, ent = logprob_kernels.token_logprobs(x, labels, 0.8, True)
        return (logp * 2).sum() + ent.sum()

    eager_in = logits.clone().requires_grad_(True)
    compiled_in = logits.clone().requires_grad_(True)
    loss(eager_in).backward()
    torch._dynamo.reset()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    compiled(compiled_in).backward()
    assert torch.allclose(compiled_in.grad, eager_in.grad, atol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_reference_path_matches_autograd_and_leaves_logits_alone(temperature, monkeypatch):
    """The reference path (CPU, or where the kernels do not run) on float32 logits: exact gradients,
    and the logits it was given are not changed in place."""
    monkeypatch.setattr(models, "LOGPROB_KERNELS", False)
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 700, generator=gen).requires_grad_(True)
    labels = torch.randint(0, 700, (2, 5), generator=gen)
    upstream = torch.randn(2, 5, generator=gen)
    scaled = logits * 1.0  # a non-leaf, as the model's output
    before = scaled.detach().clone()
    logp, ent = models.token_logprobs(scaled, labels, temperature, True)
    (logp * upstream).sum().backward()
    assert torch.equal(scaled.detach(), before)
    want_logp, want_ent = reference(before, labels, temperature)
    assert torch.allclose(logp, want_logp, atol=1e-5) and torch.allclose(ent, want_ent, atol=1e-5)
    leaf = before.clone().requires_grad_(True)
    (reference(leaf, labels, temperature)[0] * upstream).sum().backward()
    assert torch.allclose(logits.grad, leaf.grad, atol=1e-6)
