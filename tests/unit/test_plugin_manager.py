"""Plugin selection by name, fail-fast errors, one answer per factory hook, introspection, kill switches."""

import io
import sys
import types

import pytest
import torch

from rlcore.errors import PluginError
from rlcore.hookspecs import FACTORY_HOOKS, hookimpl
from rlcore.plugin_manager import (
    DEFAULT_PLUGINS,
    ENV_DISABLE_AUTOLOAD,
    RLCorePluginManager,
    available_names,
    build_plugin_manager,
)
from rlcore.protocols import DistInfo, PlacementRequest


def test_defaults_are_registered_first_and_flagged():
    pm = build_plugin_manager(["sparse-logging"])
    infos = pm.infos()
    assert [i.name for i in infos] == [*DEFAULT_PLUGINS, "sparse-logging"]
    assert all(i.default for i in infos[:-1]) and not infos[-1].default
    assert "rlcore_dataset_provider" in infos[0].hooks
    assert infos[0].distribution == "rlcore"


def test_builtin_plugins_come_from_the_entry_point_group():
    assert {"defaults", "streaming", "remesh", "rm-offload", "sparse-logging"} <= set(available_names())


def test_unknown_name_lists_available_and_nearest(monkeypatch):
    imported = []
    monkeypatch.setattr("importlib.import_module", lambda name, *a: imported.append(name))
    with pytest.raises(PluginError) as e:
        build_plugin_manager(["sparse-logging", "streamng"])
    text = str(e.value)
    assert "unknown plugin 'streamng'" in text and "did you mean 'streaming'" in text
    assert "available plugins:" in text and "remesh" in text
    assert imported == []  # nothing imported when a name is wrong


def _fake_distribution(root, name, entry_value):
    """An installed distribution (dist-info on sys.path) whose plugin entry point points at ``entry_value``."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[rlcore.plugins]\n{name} = {entry_value}\n")


def test_import_failure_names_plugin_and_distribution(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "brokenplug", "rlcore_no_such_module_xyz")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as e:
        build_plugin_manager(["brokenplug"])
    assert 'Error importing plugin "brokenplug"' in str(e.value)
    assert "brokenplug" in str(e.value).split("distribution")[1]
    assert isinstance(e.value.__cause__, ImportError)


def test_third_party_plugin_by_entry_point(tmp_path, monkeypatch):
    (tmp_path / "rlcore_fake_thirdparty.py").write_text(
        "from rlcore.hookspecs import hookimpl\n"
        "@hookimpl\n"
        "def rlcore_metrics(step, metrics, split):\n"
        "    metrics['seen_by_fake'] = step\n")
    _fake_distribution(tmp_path, "fakeplug", "rlcore_fake_thirdparty")
    monkeypatch.syspath_prepend(str(tmp_path))
    pm = build_plugin_manager(["fakeplug"])
    info = pm.infos()[-1]
    assert (info.name, info.distribution, info.version) == ("fakeplug", "fakeplug", "0.1")
    m = {}
    pm.hook.rlcore_metrics(step=4, metrics=m, split="train")
    assert m["seen_by_fake"] == 4


def _placement(label):
    """A placement policy written to the protocol (subclassing nothing), told apart by ``label``."""
    cpu = torch.device("cpu")
    return types.SimpleNamespace(label=label, device_for=lambda role: cpu, ranks_for=lambda role: [0],
                                 offload=lambda role: False)


def _factory_plugin(name, value):
    mod = types.ModuleType(name)
    value = _placement(value) if isinstance(value, str) else value

    @hookimpl
    def rlcore_placement_policy(request, dist):
        return value

    mod.rlcore_placement_policy = rlcore_placement_policy
    return mod


def test_selected_plugin_overrides_default_and_two_conflict():
    pm = RLCorePluginManager()
    pm.load(["defaults"], default=True)
    args = dict(request=PlacementRequest(), dist=DistInfo())
    default_answer = pm.build("rlcore_placement_policy", **args)
    assert type(default_answer).__name__ == "ColocatedPlacement"
    pm.register_plugin(_factory_plugin("a", "A"), "a")
    assert pm.build("rlcore_placement_policy", **args).label == "A"
    pm.register_plugin(_factory_plugin("b", "B"), "b")
    with pytest.raises(PluginError) as e:
        pm.build("rlcore_placement_policy", **args)
    assert "'a'" in str(e.value) and "'b'" in str(e.value)


def test_plugin_passing_with_none_does_not_count():
    pm = build_plugin_manager([])
    pm.register_plugin(_factory_plugin("quiet", None), "quiet")
    assert type(pm.build("rlcore_placement_policy", request=PlacementRequest(), dist=DistInfo())).__name__ \
        == "ColocatedPlacement"


def test_unknown_hook_in_a_plugin_is_an_error():
    mod = types.ModuleType("typo")

    @hookimpl
    def rlcore_step_strat(step):
        return None

    mod.rlcore_step_strat = rlcore_step_strat
    pm = build_plugin_manager([])
    pm.register_plugin(mod, "typo")
    with pytest.raises(Exception, match="rlcore_step_strat"):
        pm.check_pending()


def test_impl_may_take_a_subset_of_arguments():
    mod = types.ModuleType("subset")
    seen = []

    @hookimpl
    def rlcore_metrics(step):
        seen.append(step)

    mod.rlcore_metrics = rlcore_metrics
    pm = RLCorePluginManager()
    pm.register_plugin(mod, "subset")
    pm.hook.rlcore_metrics(step=3, metrics={}, split="train")
    assert seen == [3]


def test_disable_autoload_keeps_builtins_only(monkeypatch):
    monkeypatch.setenv(ENV_DISABLE_AUTOLOAD, "1")
    names = available_names()
    assert "streaming" in names
    # every plugin this package ships stays selectable: the built-in list covers its entry points
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    shipped = project["project"]["entry-points"]["rlcore.plugins"]
    assert set(shipped) <= set(names), sorted(set(shipped) - set(names))
    from importlib import metadata

    third = metadata.EntryPoint(name="thirdparty", value="x", group="rlcore.plugins")
    monkeypatch.setattr("rlcore.plugin_manager.metadata.entry_points", lambda group: [third])
    assert "thirdparty" not in available_names()
    with pytest.raises(PluginError, match=ENV_DISABLE_AUTOLOAD):
        build_plugin_manager(["thirdparty"])


def test_trace_env_prints_hook_calls(monkeypatch):
    monkeypatch.setenv("RLCORE_TRACE_PLUGINS", "1")
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    pm = build_plugin_manager([])
    pm.build("rlcore_placement_policy", request=PlacementRequest(), dist=DistInfo())
    assert "rlcore_placement_policy" in err.getvalue() and "defaults" in err.getvalue()


def test_every_factory_hook_has_a_default_answer():
    pm = build_plugin_manager([])
    for name in FACTORY_HOOKS:
        assert getattr(pm.hook, name).get_hookimpls(), name


def test_register_fixture_unregisters(rlcore_pm, rlcore_register):
    rlcore_register(_factory_plugin("temp", "T"), "temp")
    assert rlcore_pm.has_plugin("temp")


def test_register_fixture_leaves_no_trace():
    from rlcore.plugin_manager import build_plugin_manager as build

    pm = build([])
    pm.register_plugin(_factory_plugin("gone", "G"), "gone")
    pm.unregister_plugin("gone")
    assert not pm.has_plugin("gone") and "gone" not in [i.name for i in pm.infos()]
