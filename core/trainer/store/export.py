"""The Hugging Face export of a policy: gathered from its shards, written atomically."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from rlcore.distributed.init import barrier
from rlcore.errors import CheckpointError
from rlcore.protocols import DistInfo
from rlcore.trainer.store.files import remove_tree, replace_dir
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
    if dist.is_main:
        tmp = target.parent / f".tmp-{target.name}"
        remove_tree(tmp)
        try:
            kwargs = {"state_dict": full} if full is not None else {}
            model.save_pretrained(str(tmp), **kwargs)
            if tokenizer is not None:
                tokenizer.save_pretrained(str(tmp))
            replace_dir(tmp, target)
        except OSError as e:
            raise CheckpointError(f"could not export the model to {target}: {e}") from e
    barrier()
    return str(target) if dist.is_main else None
