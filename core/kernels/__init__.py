"""GPU kernels (Triton), in one place.

Each module holds one family of kernels with the PyTorch code that launches them and a reference
in plain PyTorch that the tests compare against:

* :mod:`rlcore.kernels.triton_support` — whether Triton kernels can run here, the interpreter
  switch, and compiling a kernel for sm_90 without a GPU (the compile tests);
* :mod:`rlcore.kernels.decode_attention` — grouped-query decode attention over the rollout
  engine's KV cache;
* :mod:`rlcore.kernels.fused_sampling` — temperature / top-k / top-p sampling in one pass;
* :mod:`rlcore.kernels.step_kernels` — the decode step's bookkeeping at each end of the step;
* :mod:`rlcore.kernels.logprob` — token log-probabilities and entropy from hidden states without
  materialising fp32 logits (the trainer's fast path).

Each kernel family is also a set of ``torch.library`` custom operators (``rlcore::*``) with fake
implementations, so that code compiled with ``torch.compile`` calls them without a graph break.
"""
