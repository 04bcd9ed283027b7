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
import typing
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Iterable, Mapping, Optional, Sequence

import pluggy
from stevedore import NamedExtensionManager

from rlcore import hookspecs
from rlcore.errors import PluginError
from rlcore.plugin_settings import SETTINGS_ARG, parse_settings, schema_of

log = logging.getLogger(__name__)

GROUP = "rlcore.plugins"
#: Built-in plugins registered before any selected one, like pytest's default plugins.
DEFAULT_PLUGINS = ("defaults", "engine", "gpu-monitor", "profiler", "metrics-file")
#: Built-in plugins and their modules (``module`` or ``module:Class``): available even when entry-point
#: autoload is disabled.
BUILTIN_MODULES = {
    "defaults": "rlcore.plugins.defaults",
    "engine": "rlcore.plugins.engine",
    "gpu-monitor": "rlcore.plugins.gpu_monitor:GPUMonitorPlugin",
    "profiler": "rlcore.plugins.profiler:ProfilerPlugin",
    "metrics-file": "rlcore.plugins.metrics_file:MetricsFilePlugin",
    "streaming": "rlcore.plugins.streaming",
    "remesh": "rlcore.plugins.remesh",
    "rm-offload": "rlcore.plugins.rm_offload",
    "sparse-logging": "rlcore.plugins.sparse_logging:SparseLoggingPlugin",
    "async": "rlcore.plugins.async_rl",
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
        self._settings: dict[str, Any] = {}
        self._warned_unused: set[str] = set()
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

    def _verify_hook(self, hook: Any, hookimpl: Any) -> None:
        """pluggy's check of an implementation, after giving one that asks for ``settings`` its plugin's."""
        if SETTINGS_ARG in hookimpl.argnames:
            function, name = hookimpl.function, hookimpl.plugin_name
            rest = tuple(a for a in hookimpl.argnames if a != SETTINGS_ARG)

            def with_settings(*args: Any, **kwargs: Any) -> Any:
                return function(**dict(zip(rest, args)), **kwargs, **{SETTINGS_ARG: self.settings_of(name)})

            hookimpl.function, hookimpl.argnames = with_settings, rest
        super()._verify_hook(hook, hookimpl)

    # -- settings -------------------------------------------------------------------------
    def configure(self, plugin_config: Optional[Mapping[str, Any]]) -> None:
        """Check ``plugin_config.<name>`` of every registered plugin against the schema it declares;
        hooks receive the result as ``settings``. A section that names neither a registered plugin
        nor an environment one registers (``rlcore_environment``: the section is that environment's
        settings) has no effect: it is logged, once per manager.

        :raises ConfigError: every unknown key and wrong value, each named ``plugin_config.<name>.<key>``.
        """
        from rlcore.errors import ConfigError

        given = dict(plugin_config or {})
        problems: list[str] = []
        for name in self.default_names + self.selected_names:
            try:
                self._settings[name] = parse_settings(name, schema_of(self.get_plugin(name)), given.get(name))
            except ConfigError as e:
                problems.extend(e.problems)
        unused = set(given) - set(self.default_names + self.selected_names)
        if unused:
            unused -= self._environment_names()  # an environment's settings (rlcore.envs)
        for name in sorted(unused - self._warned_unused):  # once per manager: configure runs again in train
            self._warned_unused.add(name)
            log.warning("plugin_config.%s has no effect: no selected plugin is named '%s' or registers an "
                        "environment of that name", name, name)
        if problems:
            raise ConfigError(problems)

    def _environment_names(self) -> set[str]:
        """The environment names the registered plugins register (``rlcore_environment``); a plugin
        whose registration fails adds none here (building the environments reports it)."""
        names: set[str] = set()
        for impl in self.hook.rlcore_environment.get_hookimpls():
            try:
                impl.function(register=lambda name, _fn: names.add(str(name)))
            except Exception:  # noqa: BLE001 - reported where the environments are built
                continue
        return names

    def settings_of(self, name: str) -> Any:
        """The settings plugin ``name`` receives (its schema's defaults before :meth:`configure`)."""
        if name not in self._settings:
            self._settings[name] = parse_settings(name, schema_of(self.get_plugin(name)), None)
        return self._settings[name]

    def unregister_plugin(self, name: str) -> None:
        """Remove a plugin registered under ``name`` (and its introspection record)."""
        if self.has_plugin(name):
            self.unregister(name=name)
        self._infos.pop(name, None)
        self._settings.pop(name, None)
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

    def implements(self, name: str, hook: str) -> bool:
        """Whether the plugin registered as ``name`` implements ``hook``."""
        plugin = self.get_plugin(name)
        return any(impl.plugin is plugin for impl in getattr(self.hook, hook).get_hookimpls())

    # -- factory hooks --------------------------------------------------------------------
    def build(self, hook_name: str, **kwargs: Any) -> Any:
        """Call a factory hook and return the one answer (:meth:`build_named` without the name)."""
        return self.build_named(hook_name, **kwargs)[1]

    def build_named(self, hook_name: str, **kwargs: Any) -> tuple[str, Any]:
        """Call a factory hook; ``(plugin name, answer)`` of the one answer, checked against its
        protocol and completed with the defaults of the optional methods it lacks (:func:`complete_answer`).

        A selected plugin's answer wins over the defaults'; two selected plugins answering raise.
        """
        if hook_name not in hookspecs.FACTORY_HOOKS:
            raise PluginError(f"'{hook_name}' is not a factory hook")
        answers = self.selected_answers(hook_name, **kwargs)
        defaults = [i for i in getattr(self.hook, hook_name).get_hookimpls()
                    if self.get_name(i.plugin) in self.default_names]
        if not answers:  # built-in defaults only when no selected plugin answers, the last registered first
            answers = self._answers(hook_name, defaults[::-1], kwargs, first=True)
        if answers:
            name, answer = answers[0]
            return name, complete_answer(hook_name, name, answer)
        raise PluginError(f"no plugin answers {hook_name}")

    def selected_answers(self, hook_name: str, **kwargs: Any) -> list[tuple[str, Any]]:
        """``[(plugin name, answer)]`` of the selected plugins (not the defaults) for a factory hook.

        :raises PluginError: two selected plugins answer.
        """
        impls = [i for i in getattr(self.hook, hook_name).get_hookimpls()
                 if self.get_name(i.plugin) not in self.default_names]
        answers = self._answers(hook_name, impls, kwargs)
        if len(answers) > 1:
            raise PluginError(f"plugins '{answers[0][0]}' and '{answers[1][0]}' both answer {hook_name}; "
                              "select only one of them")
        return answers

    def _answers(self, hook_name: str, impls: Sequence[Any], kwargs: dict,
                 first: bool = False) -> list[tuple[str, Any]]:
        """Call each implementation alone (through pluggy, so tracing sees it); keep non-None answers
        (only the first with ``first``)."""
        out = []
        for impl in impls:
            others = [p for p in self.get_plugins() if p is not impl.plugin]
            result = self.subset_hook_caller(hook_name, remove_plugins=others)(**kwargs)
            if result:
                out.append((self.get_name(impl.plugin) or repr(impl.plugin), result[0]))
                if first:
                    break
        return out


def provides_data(pm: RLCorePluginManager) -> bool:
    """Whether a selected plugin implements ``rlcore_dataset_provider`` (it is the run's data source)."""
    return any(pm.implements(n, "rlcore_dataset_provider") for n in pm.selected_names)


def factory_protocols() -> dict[str, type]:
    """The protocol (``rlcore.protocols``) each factory hook's answer must satisfy."""
    from rlcore import protocols

    return {"rlcore_placement_policy": protocols.PlacementPolicy, "rlcore_reshard_policy": protocols.ReshardPolicy,
            "rlcore_reward_backend": protocols.RewardBackend, "rlcore_checkpoint_policy": protocols.CheckpointPolicy,
            "rlcore_rollout_backend": protocols.RolloutBackend, "rlcore_world_split": protocols.WorldSplit}


def protocol_methods(protocol: type) -> list[str]:
    """The methods a protocol declares (the ones the core calls)."""
    return sorted(n for klass in protocol.__mro__ if klass not in (object, typing.Protocol, typing.Generic)
                  for n, v in vars(klass).items() if callable(v) and not n.startswith("_"))


def check_answer(hook_name: str, plugin: str, answer: Any) -> None:
    """Raise :class:`PluginError` naming ``plugin`` and what is missing when ``answer`` does not
    satisfy the protocol of ``hook_name`` (a dataset: neither ``__getitem__`` nor ``__iter__``). A
    method added after the protocol's first release (:data:`rlcore.protocols.OPTIONAL_METHODS`) may
    be missing: :func:`complete_answer` gives the default."""
    if hook_name == "rlcore_dataset_provider":
        if not (hasattr(answer, "__getitem__") or hasattr(answer, "__iter__")):
            raise PluginError(f"plugin '{plugin}' answered {hook_name} with a {type(answer).__name__}, which is "
                              "neither a map-style dataset (__getitem__, __len__) nor an iterable one (__iter__)")
        return
    protocol = factory_protocols().get(hook_name)
    if protocol is None or isinstance(answer, protocol):
        return
    from rlcore.protocols import OPTIONAL_METHODS

    methods = protocol_methods(protocol)
    optional = OPTIONAL_METHODS.get(protocol.__name__, {})
    missing = [m for m in methods if m not in optional and not callable(getattr(answer, m, None))]
    if not missing:
        return
    raise PluginError(f"plugin '{plugin}' answered {hook_name} with a {type(answer).__name__}, which lacks "
                      f"{', '.join(m + '()' for m in missing)}: a {protocol.__name__} (rlcore.protocols) has "
                      f"{', '.join(m + '()' for m in methods)}")


class AnswerWithDefaults:
    """A plugin's factory answer with the defaults of the methods it lacks (see :func:`complete_answer`):
    every other attribute is the answer's own."""

    def __init__(self, answer: Any, methods: dict[str, Any]):
        self.__dict__.update(methods, _answer=answer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_answer"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["_answer"], name, value)

    def __repr__(self) -> str:
        return f"{self.__dict__['_answer']!r} (with rlcore's defaults)"


def complete_answer(hook_name: str, plugin: str, answer: Any) -> Any:
    """``answer`` checked (:func:`check_answer`) and, where it was written for an earlier plugin API,
    completed: a method of :data:`rlcore.protocols.OPTIONAL_METHODS` it lacks is the default of the
    protocol's base class (:data:`rlcore.protocols.BASES`), and a method lacking a keyword parameter
    of :data:`rlcore.protocols.OPTIONAL_PARAMETERS` is called without it. Each is announced by a
    ``DeprecationWarning`` (and a log line) naming the plugin. The answer itself when nothing lacks."""
    import functools
    import inspect
    import types
    import warnings

    from rlcore import PLUGIN_API_VERSION
    from rlcore.protocols import BASES, OPTIONAL_METHODS, OPTIONAL_PARAMETERS

    check_answer(hook_name, plugin, answer)
    protocol = factory_protocols().get(hook_name)
    if protocol is None:
        return answer
    kind = protocol.__name__
    added: dict[str, Any] = {}
    notes = []
    for method, version in OPTIONAL_METHODS.get(kind, {}).items():
        if not callable(getattr(answer, method, None)):
            added[method] = types.MethodType(getattr(BASES[kind], method), answer)
            notes.append(f"lacks {method}() (plugin API {version})")
    for method, (param, version) in OPTIONAL_PARAMETERS.get(kind, {}).items():
        bound = getattr(answer, method, None)
        try:
            params = inspect.signature(bound).parameters
        except (TypeError, ValueError):
            continue
        if param in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        added[method] = functools.wraps(bound)(lambda *a, _call=bound, _drop=param, **kw: _call(
            *a, **{k: v for k, v in kw.items() if k != _drop}))
        notes.append(f"{method}() takes no {param}= (plugin API {version})")
    if not added:
        return answer
    message = (f"plugin '{plugin}': its {kind} ({type(answer).__name__}) {'; '.join(notes)}: rlcore uses the "
               f"defaults of rlcore.protocols.{BASES[kind].__name__}. Written for an earlier plugin API than "
               f"{PLUGIN_API_VERSION}; inherit that class or add the method (docs/plugins.md, 'Plugin API versions')")
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    log.warning("%s", message)
    return AnswerWithDefaults(answer, added)


def close_answer(answer: Any) -> None:
    """Release what a factory answer holds: its ``close()``, where it has one (a failure is logged,
    not raised: closing never hides the run's own outcome)."""
    close = getattr(answer, "close", None)
    if callable(close):
        try:
            close()
        except Exception as error:  # noqa: BLE001 - logged; the run's own error or result stands
            log.warning("closing %s failed: %s: %s", type(answer).__name__, type(error).__name__, error)


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
