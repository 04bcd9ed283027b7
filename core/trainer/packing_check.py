"""Whether the training forwards may pack (``ppo.pack_sequences``): a check on the real model that
packed sequences (:mod:`rlcore.trainer.packing`) do not see each other, and the setting resolved
from it. Apart from :mod:`rlcore.trainer.packing` because it runs the model's forwards
(:mod:`rlcore.trainer.models`), which pack with that module."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from rlcore.trainer.models import ValueModel, response_logprobs, response_values
from rlcore.trainer.packing import attention_implementation

log = logging.getLogger(__name__)


def _tolerance(model: torch.nn.Module) -> float:
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    return 1e-3 if dtype == torch.float32 else 5e-2


@torch.no_grad()
def packing_isolates(model: torch.nn.Module) -> tuple[bool, str]:
    """Whether ``model`` keeps packed sequences apart: a short sequence's log-probs packed after a
    longer one equal its log-probs alone. ``(ok, why not)``; any error of the packed forward is a no."""

    def run(ids, mask, response_len, **kw):
        if isinstance(model, ValueModel):
            return response_values(model, ids, mask, response_len, **kw)
        return response_logprobs(model, ids, mask, response_len, **kw)[0]

    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    if vocab < 4:
        return False, "the model has no config.vocab_size"
    g = torch.Generator().manual_seed(1234)
    first = torch.randint(2, vocab, (24,), generator=g)
    second = torch.randint(2, vocab, (8,), generator=g)
    ids = torch.zeros(2, 24, dtype=torch.long)
    mask = torch.zeros(2, 24, dtype=torch.long)
    ids[0], mask[0] = first, 1
    ids[1, -8:], mask[1, -8:] = second, 1
    response_len = 6
    resp = torch.ones(2, response_len)
    ids, mask, resp = ids.to(device), mask.to(device), resp.to(device)
    was_training = model.training
    model.eval()
    try:
        alone = run(ids[1:], mask[1:], response_len)
        packed = run(ids, mask, response_len, response_mask=resp, packed=True)
    except Exception as e:  # noqa: BLE001 - any failure means: do not pack this model
        return False, f"a packed forward failed ({type(e).__name__}: {e})"
    finally:
        model.train(was_training)
    diff = float((packed[1] - alone[0]).abs().max())
    tol = _tolerance(model)
    if not diff <= tol:
        return False, (f"a sequence packed after another differs from the same sequence alone by {diff:.3g} "
                       f"(> {tol}) in its output: its attention ({attention_implementation(model) or 'custom'}) "
                       "sees the other sequence")
    return True, ""


#: Attention implementations whose packed form costs what the sequences cost (a variable-length
#: kernel, or a block-sparse mask); with the others (sdpa, eager) a packed row is one dense
#: ``[L, L]`` masked attention, quadratic in the packed length.
VARLEN_ATTENTION = ("flash_attention", "flex_attention")


def resolve_packing(setting, models: Sequence[Optional[torch.nn.Module]]) -> bool:
    """``ppo.pack_sequences`` (true | false | auto) -> whether the training forwards pack.

    ``auto`` packs when every model runs a variable-length attention (:data:`VARLEN_ATTENTION`)
    and passes :func:`packing_isolates`; ``true`` packs with any attention that passes the check.

    :raises ConfigError: ``true`` and a model does not keep packed sequences apart.
    """
    from rlcore.errors import ConfigError

    if setting is False or str(setting).lower() == "false":
        return False
    auto = not (setting is True or str(setting).lower() == "true")
    for model in models:
        if model is None:
            continue
        impl = attention_implementation(model)
        if auto and not any(impl.startswith(k) for k in VARLEN_ATTENTION):
            log.info("ppo.pack_sequences=auto: training forwards stay padded (%s attention '%s' would run a packed "
                     "row as one dense masked attention; ppo.pack_sequences=true packs anyway)",
                     type(model).__name__, impl or "custom")
            return False
        ok, why = packing_isolates(model)
        if not ok:
            if not auto:
                raise ConfigError([f"'ppo.pack_sequences' = true: {type(model).__name__}: {why}; set "
                                   "ppo.pack_sequences=false (padded forwards) or auto"])
            log.info("ppo.pack_sequences=auto: training forwards stay padded (%s: %s)", type(model).__name__, why)
            return False
    return True
