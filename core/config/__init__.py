"""Typed configuration: schema dataclasses and the loader."""

from rlcore.config.loader import SCHEMA_KEYS, check_config, load_config, section, suggest, to_yaml
from rlcore.config.schema import RLCoreConfig

__all__ = ["RLCoreConfig", "SCHEMA_KEYS", "check_config", "load_config", "section", "suggest", "to_yaml"]
