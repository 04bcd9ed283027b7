"""The Hugging Face export of a policy: gathered from its shards, written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch

from rlcore.distributed.init import barrier
from rlcore.errors import CheckpointError
from rlcore.protocols import DistInfo
from rlcore.trainer.store.files import no_space_message, remove_tree, replace_dir
from rlcore.trainer.store.state import is_sharded


def export_hf(model: torch.nn.Module, tokenizer: Any, target: Path, dist: DistInfo) -> Optional[str]:
    """Write ``model`` and ``tokenizer`` to ``target`` atomically; FSDP shards are gathered first (collective)."""
    if not hasattr(model, "save_pretrained"):
        raise CheckpointError(f"cannot export {type(model).__name__} as a Hugging Face directory: "
                              "it has no save_pretrained()")
    full = None
    if is_sharded(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    from rlcore.rollout.adapters import is_lora

    if is_lora(model):
        return _export_lora(model, full, tokenizer, target, dist)
    if dist.is_main:
        kwargs = {"state_dict": full} if full is not None else {}
        _write_hf_dir(target, lambda d: model.save_pretrained(d, **kwargs), tokenizer)
    barrier()
    return str(target) if dist.is_main else None


def _write_hf_dir(target: Path, write: Callable[[str], None], tokenizer: Any) -> None:
    """``write(dir)`` and the tokenizer into a temporary directory, then moved to ``target`` atomically."""
    tmp = target.parent / f".tmp-{target.name}"
    remove_tree(tmp)
    try:
        write(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        replace_dir(tmp, target)
    except Exception as e:  # a full disk is an OSError, or a library's own error (safetensors) that says so
        full = no_space_message(target, e)
        if full is None and not isinstance(e, OSError):
            raise
        remove_tree(tmp)
        raise CheckpointError(f"could not export the model to {target}: {full or e}; the last checkpoint holds "
                              "the trained state: trainer.resume=auto exports it again") from e


def _export_lora(model: torch.nn.Module, full: Optional[dict], tokenizer: Any, target: Path,
                 dist: DistInfo) -> Optional[str]:
    """A LoRA actor's export: the merged model at ``target`` (a plain Hugging Face directory) and the
    adapter alone at ``target-adapter`` (``peft`` format, loads on top of the base model)."""
    from rlcore.trainer.lora import lora_scale, merged_state_dict

    if dist.is_main:
        state = full if full is not None else {k: v.detach().cpu() for k, v in model.state_dict().items()}
        _write_hf_dir(target.parent / f"{target.name}-adapter", lambda d: model.save_pretrained(d, state_dict=state),
                      tokenizer)
        merged = merged_state_dict(state, lora_scale(model))
        _write_hf_dir(target, lambda d: model.get_base_model().save_pretrained(d, state_dict=merged), tokenizer)
    barrier()
    return str(target) if dist.is_main else None
