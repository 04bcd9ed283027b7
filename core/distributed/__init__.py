"""Everything that touches ``torch.distributed``: process groups, placement, FSDP2 and re-sharding."""
