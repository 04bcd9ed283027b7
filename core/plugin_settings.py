"""A plugin's own settings: the ``plugin_config.<name>`` section, checked against the schema it declares.

A plugin declares its settings as a dataclass in the attribute ``settings_schema`` (of its module,
or of its class for a class plugin). Every hook implementation that names a ``settings`` parameter
receives the checked section: an instance of that dataclass (defaults filled in), or, for a plugin
without a schema, the section as a read-only mapping (empty when absent).
"""

from __future__ import annotations

import dataclasses
import difflib
from types import MappingProxyType
from typing import Any, Mapping, Optional

from rlcore.errors import ConfigError

#: The parameter name through which a hook implementation receives its plugin's settings.
SETTINGS_ARG = "settings"


def schema_of(plugin: Any) -> Optional[type]:
    """The dataclass a plugin declares as ``settings_schema``, or None.

    :raises ConfigError: the attribute is set to something that is not a dataclass.
    """
    schema = getattr(plugin, "settings_schema", None)
    if schema is not None and not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise ConfigError([f"plugin settings_schema must be a dataclass, got {schema!r}"])
    return schema


def parse_settings(name: str, schema: Optional[type], raw: Optional[Mapping[str, Any]]) -> Any:
    """``plugin_config.<name>`` as the plugin receives it.

    :raises ConfigError: listing every unknown key (with the nearest valid one) and every value
        of the wrong type, each named ``plugin_config.<name>.<key>``.
    """
    raw = dict(raw or {})
    if schema is None:
        return MappingProxyType(raw)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    known = [f.name for f in dataclasses.fields(schema)]
    problems = []
    for key in raw:
        if key not in known:
            near = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            problems.append(f"'plugin_config.{name}.{key}': plugin '{name}' has no such setting"
                            + (f" (did you mean '{near[0]}'?)" if near else "")
                            + f"; its settings: {', '.join(known) or 'none'}")
    if problems:
        raise ConfigError(problems)
    node = OmegaConf.structured(schema)
    for key, value in raw.items():
        try:
            OmegaConf.update(node, key, value, merge=True)
        except OmegaConfBaseException as e:
            problems.append(f"'plugin_config.{name}.{key}' = {value!r}: {str(e).splitlines()[0]}")
    try:
        OmegaConf.to_container(node, throw_on_missing=True)
    except OmegaConfBaseException as e:
        problems.append(f"'plugin_config.{name}.{getattr(e, 'full_key', '')}': is required by plugin '{name}'")
    if problems:
        raise ConfigError(problems)
    return OmegaConf.to_object(node)
