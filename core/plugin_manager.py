"""Build the plugin manager: built-in defaults first, then the plugins selected by name.

Plugins are modules (or objects) exposing ``@hookimpl`` functions, found through the
``rlcore.plugins`` entry-point group, built-in ones included. The manager is created in ``main()``
and passed along; nothing here is a module global.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import sys
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Iterable, Sequence

import pluggy
from stevedore import NamedExtensionManager

from rlcore import hookspecs
from rlcore.errors import PluginError

log = logging.getLogger(__name__)

GROUP = "rlcore.plugins"
#: Built-in plugins registered before any selected one, like pytest's default plugins.
DEFAULT_PLUGINS = ("defaults", "gpu-monitor", "profiler")
#: Built-in plugins and their modules (``module`` or ``module:Class``): available even when entry-point
#: autoload is disabled.
BUILTIN_MODULES = {
    "defaults": "rlcore.plugins.defaults",
    "gpu-monitor": "rlcore.plugins.gpu_monitor:GPUMonitorPlugin",
    "profiler": "rlcore.plugins.profiler:ProfilerPlugin",
    "streaming": "rlcore.plugins.streaming",
    "remesh": "rlcore.plugins.remesh",
    "rm-offload": "rlcore.plugins.rm_offload",
    "sparse-logging": "rlcore.plugins.sparse_logging",
}
ENV_DISABLE_AUTOLOAD = "RLCORE_DISABLE_PLUGIN_AUTOLOAD"
ENV_TRACE = "RLCORE_TRACE_PLUGINS"


@dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    default: bool
    hooks: tuple[str, ...]


def _truthy(value: str | None) -> bool:
    return bool(value) and value.strip().lower() not in ("0", "false", "no", "")


def autoload_disabled() -> bool:
    return _truthy(os.environ.get(ENV_DISABLE_AUTOLOAD))


def available_entry_points() -> dict[str, metadata.EntryPoint]:
    """Entry points of the group by name, read from metadata only (nothing is imported)."""
    if autoload_disabled():
        return {}
    found: dict[str, metadata.EntryPoint] = {}
    for ep in metadata.entry_points(group=GROUP):
        found.setdefault(ep.name, ep)
    return found


def available_names() -> list[str]:
    return sorted(set(available_entry_points()) | set(BUILTIN_MODULES))


def _distribution_of(ep: metadata.EntryPoint | None) -> tuple[str, str]:
    dist = getattr(ep, "dist", None) if ep is not None else None
    if dist is not None:
        return dist.metadata["Name"], dist.version
    from rlcore import __version__

    return "rlcore", __version__


def parse_plugin_names(spec: str | Sequence[str] | None) -> list[str]:
    if spec is None:
        return []
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for raw in items:
        name = str(raw).strip()
        if name and name not in out:
            out.append(name)
    return out


def check_names(names: Iterable[str]) -> None:
    """Raise :class:`PluginError` for names that no installed plugin has, before importing anything."""
    available = available_names()
    unknown = [n for n in names if n not in available]
    if not unknown:
        return
    lines = []
    for n in unknown:
        near = difflib.get_close_matches(n, available, n=1, cutoff=0.5)
        lines.append(f"unknown plugin '{n}'" + (f" (did you mean '{near[0]}'?)" if near else ""))
    lines.append("available plugins: " + ", ".join(available))
    if autoload_disabled():
        lines.append(f"{ENV_DISABLE_AUTOLOAD} is set: only built-in plugins are available")
    raise PluginError("\n".join(lines))


class RLCorePluginManager(pluggy.PluginManager):
    """A pluggy manager that also knows which plugins are defaults and enforces one answer per factory hook."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT)
        self.add_hookspecs(hookspecs)
        self.default_names: list[str] = []
        self.selected_names: list[str] = []
        self._infos: dict[str, PluginInfo] = {}
        self._undo_trace = None
        if _truthy(os.environ.get(ENV_TRACE)):
            self.enable_trace(sys.stderr)

    # -- loading --------------------------------------------------------------------------
    def register_plugin(self, plugin: Any, name: str, *, default: bool = False,
                        distribution: tuple[str, str] = ("", "")) -> None:
        """Register an imported plugin object under ``name`` and record what it implements."""
        if self.has_plugin(name):
            raise PluginError(f"plugin '{name}' is registered twice")
        self.register(plugin, name=name)
        hooks = tuple(sorted(h.name for h in self.get_hookcallers(plugin) or ()))
        dist, version = distribution if distribution[0] else _distribution_of(None)
        self._infos[name] = PluginInfo(name, dist, version, default, hooks)
        (self.default_names if default else self.selected_names).append(name)

    def load(self, names: Sequence[str], *, default: bool = False) -> None:
        """Import and register plugins by name (entry points, or built-ins when autoload is off)."""
        names = [n for n in parse_plugin_names(names) if not self.has_plugin(n)]
        if not names:
            return
        check_names(names)
        eps = available_entry_points()
        from_eps = [n for n in names if n in eps]
        loaded: dict[str, Any] = {}
        if from_eps:
            def on_failure(_mgr: Any, ep: metadata.EntryPoint, err: BaseException) -> None:
                dist, _ = _distribution_of(eps.get(ep.name, ep))
                raise PluginError(f'Error importing plugin "{ep.name}" (distribution {dist}): '
                                  f"{type(err).__name__}: {err}") from err

            # stevedore memoises entry points per process; re-read them so that what it loads
            # agrees with the names checked above (a distribution may have been installed since).
            NamedExtensionManager.ENTRY_POINT_CACHE.pop(GROUP, None)
            mgr = NamedExtensionManager(GROUP, names=from_eps, on_load_failure_callback=on_failure,
                                        on_missing_entrypoints_callback=lambda missing: None, name_order=True)
            for ext in mgr.extensions:
                # stevedore caches entry points without their distribution: take it from metadata.
                loaded[ext.name] = (ext.plugin, _distribution_of(eps.get(ext.name, ext.entry_point)))
        for n in names:
            if n in loaded:
                continue
            ep = eps.get(n)  # installed after stevedore's path cache was filled in this process
            dist = _distribution_of(ep)
            try:
                loaded[n] = (ep.load() if ep is not None else _import_builtin(BUILTIN_MODULES[n]), dist)
            except Exception as err:
                raise PluginError(f'Error importing plugin "{n}" (distribution {dist[0]}): '
                                  f"{type(err).__name__}: {err}") from err
        for n in names:
            plugin, dist = loaded[n]
            if isinstance(plugin, type):  # a plugin class: one instance per manager holds its per-run state
                try:
                    plugin = plugin()
                except Exception as err:
                    raise PluginError(f'plugin "{n}" (distribution {dist[0]}): creating {plugin.__name__}() '
                                      f"failed: {type(err).__name__}: {err}") from err
            try:
                self.register_plugin(plugin, n, default=default, distribution=dist)
            except pluggy.PluginValidationError as err:
                raise PluginError(f"plugin '{n}' is invalid: {err}") from err
        try:
            self.check_pending()
        except pluggy.PluginValidationError as err:
            raise PluginError(f"plugin implements an unknown hook: {err}") from err

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin registered under ``name`` (and its introspection record)."""
        if self.has_plugin(name):
            self.unregister(name=name)
        self._infos.pop(name, None)
        for names in (self.default_names, self.selected_names):
            if name in names:
                names.remove(name)

    # -- introspection --------------------------------------------------------------------
    def infos(self) -> list[PluginInfo]:
        return [self._infos[n] for n in self.default_names + self.selected_names]

    def enable_trace(self, stream: Any) -> None:
        def before(hook_name: str, impls: Sequence[Any], kwargs: dict) -> None:
            names = ", ".join(self.get_name(i.plugin) or "?" for i in impls)
            stream.write(f"[rlcore trace] {hook_name}({', '.join(kwargs)}) -> {names}\n")

        def after(outcome: Any, hook_name: str, impls: Sequence[Any], kwargs: dict) -> None:
            return None

        self._undo_trace = self.add_hookcall_monitoring(before, after)

    # -- factory hooks --------------------------------------------------------------------
    def build(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a factory hook and return the one answer.

        A selected plugin's answer wins over the defaults'; two selected plugins answering raise.
        """
        if hook_name not in hookspecs.FACTORY_HOOKS:
            raise PluginError(f"'{hook_name}' is not a factory hook")
        caller = getattr(self.hook, hook_name)
        impls = caller.get_hookimpls()
        selected = [i for i in impls if self.get_name(i.plugin) not in self.default_names]
        defaults = [i for i in impls if self.get_name(i.plugin) in self.default_names]
        answers = self._answers(hook_name, selected, kwargs)
        if len(answers) > 1:
            raise PluginError(f"plugins '{answers[0][0]}' and '{answers[1][0]}' both answer {hook_name}; "
                              "select only one of them")
        if not answers:  # defaults are asked only when no selected plugin answers
            answers = self._answers(hook_name, defaults, kwargs)[-1:]
        if answers:
            return answers[0][1]
        raise PluginError(f"no plugin answers {hook_name}")

    def _answers(self, hook_name: str, impls: Sequence[Any], kwargs: dict) -> list[tuple[str, Any]]:
        """Call each implementation alone (through pluggy, so tracing sees it); keep non-None answers."""
        out = []
        for impl in impls:
            others = [p for p in self.get_plugins() if p is not impl.plugin]
            result = self.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)
            if result:
                out.append((self.get_name(impl.plugin) or repr(impl.plugin), result[0]))
        return out


def _import_builtin(spec: str) -> Any:
    """``module`` or ``module:attribute``."""
    module, _, attr = spec.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attr) if attr else obj


def build_plugin_manager(selected: Sequence[str] = ()) -> RLCorePluginManager:
    """Create a plugin manager with the defaults and the ``selected`` plugins registered.

    :raises PluginError: unknown names (listing the available ones), import failures, conflicts.
    """
    names = parse_plugin_names(selected)
    check_names(names)  # all names first: nothing is imported if any is wrong
    pm = RLCorePluginManager()
    pm.load(list(DEFAULT_PLUGINS), default=True)
    pm.load(names)
    return pm
