"""The ``rlcore`` command: ``train``, ``config``, ``validate``, ``plugins`` (and observability tools)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from rlcore import __version__
from rlcore.errors import RLCoreError

log = logging.getLogger("rlcore")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "--config_path", "--config-path", dest="config", action="append", default=[],
                   metavar="YAML", help="config file (repeatable; later files override earlier ones)")
    p.add_argument("--plugins", "-p", action="append", default=[], metavar="A,B",
                   help="plugins to load by name from the 'rlcore.plugins' entry-point group")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, e.g. ppo.kl_coeff=0.05")


def is_demo(config_files: Sequence[str], overrides: Sequence[str]) -> bool:
    """No config file, no data and no model given: ``rlcore train`` runs the built-in demo."""
    keys = {o.split("=", 1)[0] for o in overrides}
    return not config_files and not {"data.train_files", "actor.model_path", "data.custom_cls.path"} & keys


def resolve(args: argparse.Namespace, *, demo_allowed: bool = True):
    """Load the config (with the demo preset when applicable) and the list of plugin names."""
    from rlcore.config import load_config
    from rlcore.plugin_manager import parse_plugin_names

    overrides = list(args.overrides)
    if demo_allowed and is_demo(args.config, overrides):
        from rlcore.demo import DEMO_OVERRIDES

        overrides = list(DEMO_OVERRIDES) + overrides
    cfg = load_config(args.config, overrides)
    names = parse_plugin_names(list(cfg.plugins) + [n for spec in args.plugins for n in parse_plugin_names(spec)])
    return cfg, names


def cmd_config(args: argparse.Namespace) -> int:
    from rlcore.config import to_yaml

    cfg, names = resolve(args)
    cfg.plugins = names
    sys.stdout.write(to_yaml(cfg))
    return 0


def preflight(cfg, names):
    """Every check that can run before a model loads: plugins, data files, model and reward-model
    paths, role devices, output directory, the checkpoint to resume from, the reward function,
    plugin requirements, rank groups and shard sizes. Every problem found is reported together.

    :raises RLCoreError: the one problem found, or an :class:`~rlcore.errors.PreflightError` listing all.
    """
    from rlcore.plugin_manager import build_plugin_manager

    pm = build_plugin_manager(names)
    from rlcore.data.provider import check_data_files, check_rows_for_batch
    from rlcore.errors import PreflightError
    from rlcore.trainer.checkpoint import check_output_dir, check_resume
    from rlcore.config.schema import trains_critic
    from rlcore.trainer.models import check_model_path

    problems: list[RLCoreError] = []

    def attempt(check, *args):
        try:
            return check(*args)
        except RLCoreError as e:
            problems.append(e)
            return None

    train_files = attempt(check_data_files, _to_object(cfg.data))
    if train_files:
        attempt(check_rows_for_batch, train_files, cfg.ppo.rollout_batch_size, _world_size(cfg))
    for role in ("actor", "critic") if trains_critic(cfg.algorithm.adv_estimator) else ("actor",):
        if cfg[role].model_path:
            attempt(check_model_path, cfg[role].model_path, f"{role}.model_path")
    if cfg.reward_model.enable:
        from rlcore.rewards.reward_model import check_reward_model_dir

        attempt(check_reward_model_dir, cfg.reward_model.path)
    attempt(_check_devices, cfg)
    attempt(check_output_dir, _to_object(cfg.trainer))
    attempt(check_resume, _to_object(cfg.trainer))
    attempt(_check_reward_function, cfg, train_files)
    attempt(_check_plugin_needs, cfg, names)
    from omegaconf import OmegaConf

    given = {"config": OmegaConf.to_container(cfg, resolve=True), "plugins": list(names)}
    for impl in pm.hook.rlcore_preflight.get_hookimpls():  # each plugin's checks, all reported
        attempt(_plugin_check, impl, given)
    attempt(_check_rank_groups, cfg)
    attempt(_check_environments, cfg, pm)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise PreflightError(problems)
    return pm


def _check_environments(cfg, pm) -> None:
    """With ``data.env_key``: the tool-call parser exists, and every environment configured under
    ``plugin_config`` builds from its settings (a bad key fails here, naming it)."""
    if not cfg.data.env_key:
        return
    from omegaconf import OmegaConf

    from rlcore.envs.runner import collect_environments
    from rlcore.errors import EnvError

    envs = collect_environments(pm, OmegaConf.to_container(cfg.plugin_config, resolve=True), cfg.env.tool_parser)
    if cfg.env.tool_parser not in envs.parsers:
        raise EnvError(f"env.tool_parser: '{cfg.env.tool_parser}' is not a registered tool-call parser; parsers: "
                       f"{', '.join(sorted(envs.parsers))}")
    for name in cfg.plugin_config:
        if name in envs.factories:
            try:
                envs.make(name)
            except ValueError as error:
                raise EnvError(f"environment '{name}': {error}") from error


def _plugin_check(impl, given: dict) -> None:
    """Run one plugin's ``rlcore_preflight``; an exception that is not an rlcore error (a bug in the
    plugin, a missing module) becomes a :class:`PluginError` naming the plugin."""
    from rlcore.errors import PluginError

    try:
        impl.function(**{name: given[name] for name in impl.argnames})
    except RLCoreError:
        raise
    except Exception as e:
        raise PluginError(f"plugin '{impl.plugin_name}': its start-up check (rlcore_preflight) failed: "
                          f"{type(e).__name__}: {e}") from e


def _check_reward_function(cfg, train_files) -> None:
    """Import the custom reward function (before the data is tokenized or a model loads) and match
    its required arguments with the columns every training file has."""
    fn = cfg.custom_reward_function
    if fn.path is None:
        return
    from rlcore.rewards.functions import check_arguments, load_function

    reward = load_function(fn.path, fn.name)
    # Columns are known for local parquet files (their footers); a jsonl file shows only its first
    # record, and remote files are not opened here, so those leave the check to the first batch.
    if train_files and all(info.format == "parquet" and info.columns for info in train_files):
        columns = set.intersection(*(set(info.columns) for info in train_files))
        check_arguments(reward, fn.name, sorted(columns), list(fn.kwargs or {}))


def _check_plugin_needs(cfg, names) -> None:
    """Settings that only work with a plugin selected, and the plugins' size rules."""
    if cfg.reward_model.enable and cfg.reward_model.offload and "rm-offload" not in names:
        from rlcore.errors import PlacementError
        from rlcore.rewards.backend import OFFLOAD_NEEDS_PLUGIN

        raise PlacementError(OFFLOAD_NEEDS_PLUGIN)
    if cfg.actor.remeshing.enabled and "remesh" not in names:
        from rlcore.errors import PluginError

        raise PluginError("actor.remeshing.enabled=true needs the 'remesh' plugin: add --plugins remesh "
                          "(or plugins: [remesh] in the config)")
    if "remesh" in names and cfg.actor.remeshing.enabled and _world_known(cfg):
        from rlcore.distributed.remesh import check_sizes

        check_sizes(_to_object(cfg.actor.remeshing), _world_size(cfg))


def _check_devices(cfg) -> None:
    """Each role's ``device`` names a device this machine has (the roles this run uses)."""
    import torch

    from rlcore.config.schema import trains_critic
    from rlcore.distributed.placement import DEVICE_KEYS, parse_device, requested_devices

    devices = requested_devices(cfg.actor, cfg.critic, cfg.reward_model, trains_critic(cfg.algorithm.adv_estimator))
    for role, spec in devices.items():
        parse_device(str(spec), torch.device("cpu"), DEVICE_KEYS[role])


def _check_rank_groups(cfg) -> None:
    """``placement.rank_groups`` against the world size, where it is known before any process starts:
    ``trainer.nproc_per_node`` (rlcore's own launcher) or torchrun's ``WORLD_SIZE``."""
    groups = _to_object(cfg.placement.rank_groups)
    world = _world_size(cfg)
    if not groups or world < 2:
        return
    from rlcore.distributed.placement import ColocatedPlacement, check_trainer_placement
    from rlcore.protocols import DistInfo, PlacementRequest

    check_trainer_placement(ColocatedPlacement(PlacementRequest(rank_groups=groups), DistInfo(world_size=world)),
                            world)


def _world_known(cfg) -> bool:
    """Whether the number of processes is known before any starts (torchrun's ``WORLD_SIZE`` or
    ``trainer.nproc_per_node`` > 1); a plain one-process command may still be started by a launcher."""
    from rlcore.distributed.init import env_int

    return env_int("WORLD_SIZE", 0) > 0 or int(cfg.trainer.nproc_per_node or 1) > 1


def _world_size(cfg) -> int:
    """Processes of the run as known before any starts: torchrun's ``WORLD_SIZE``, else ``trainer.nproc_per_node``."""
    from rlcore.distributed.init import env_int

    return env_int("WORLD_SIZE", 0) or int(cfg.trainer.nproc_per_node or 1)


def _to_object(node):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(node)


def cmd_validate(args: argparse.Namespace) -> int:
    cfg, names = resolve(args)
    preflight(cfg, names)
    print(f"config OK ({len(names)} plugin(s): {', '.join(names) or 'defaults only'})")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from rlcore.plugin_manager import available_names, build_plugin_manager

    names = [n for n in available_names() if n != "defaults"]
    pm = build_plugin_manager(names)
    rows = [(i.name, i.distribution, i.version, "yes" if i.default else "", ", ".join(
        h.replace("rlcore_", "") for h in i.hooks)) for i in pm.infos()]
    head = ("name", "distribution", "version", "default", "hooks")
    widths = [max(len(str(r[k])) for r in rows + [head]) for k in range(4)]
    for r in [head] + rows:
        print("  ".join(str(r[k]).ljust(widths[k]) for k in range(4)) + "  " + r[4])
    from rlcore.envs.runner import collect_environments

    envs = collect_environments(pm)
    print("\nenvironments (data.env_key; settings under plugin_config.<name>):")
    for name, (_, plugin) in sorted(envs.factories.items()):
        print(f"  {name.ljust(16)}  from plugin {plugin}")
    print("tool-call parsers (env.tool_parser): " + ", ".join(sorted(envs.parsers)))
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from rlcore.config.inert import idle_plugins, inert_keys
    from rlcore.distributed.init import init_distributed
    from rlcore.distributed.launch import maybe_launch

    cfg, names = resolve(args)
    pm = preflight(cfg, names)
    if maybe_launch(int(cfg.trainer.nproc_per_node), sys.argv[2:] if args.argv is None else list(args.argv)):
        return 0
    dist = init_distributed(cfg.trainer.device)
    demo = is_demo(args.config, args.overrides)
    if dist.is_main:
        preset = set()
        if demo:  # keys the demo preset set, unless the user set them too
            from rlcore.demo import DEMO_OVERRIDES

            preset = {o.split("=", 1)[0] for o in DEMO_OVERRIDES} - {o.split("=", 1)[0] for o in args.overrides}
        for key, why in inert_keys(cfg, names, dist.world_size, ignore=preset):
            log.warning("config key '%s' has no effect in this run: %s", key, why)
        for name, why in idle_plugins(cfg, names):
            log.warning("plugin '%s' is selected but does nothing in this run: %s", name, why)
        if demo:
            log.warning("no data or model given: running the built-in demo (tiny model, alphabet task)")
        elif not cfg.data.train_files and not cfg.data.custom_cls.path:
            log.warning("data.train_files is not set: the run trains on the built-in demo task (the alphabet "
                        "prompts)%s", "" if cfg.actor.model_path else " with the demo's tiny model")
    from rlcore.trainer.loop import Trainer

    trainer = Trainer(cfg, pm, dist)
    summary = trainer.train()
    if dist.is_main:
        print_summary(summary, cfg.trainer.output_dir)
        if trainer.status == "interrupted":
            print(f"run interrupted at step {trainer.state.step} of {cfg.trainer.max_steps}: a checkpoint was saved; "
                  "the same command with trainer.resume=auto continues it")
    return 0  # a graceful stop (SIGINT/SIGTERM, checkpoint saved) is not a failure for launchers


def print_summary(summary: dict, run_dir: str) -> None:
    before, after = summary.get("before/reward_mean"), summary.get("after/reward_mean")
    print("\n=== rlcore summary ===")
    if before is not None and after is not None:
        print(f"held-out mean reward: {before:.3f} -> {after:.3f} ({after - before:+.3f})")
    elif after is not None:
        print(f"held-out mean reward: {after:.3f}")
    elif before is not None:
        print(f"held-out mean reward before training: {before:.3f} (no final evaluation: the run stopped early)")
    for k, v in sorted(summary.items()):
        if not k.endswith("reward_mean"):
            print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    print(f"run directory: {run_dir}")
    from rlcore.observe.plot import dashboard_line

    line = dashboard_line(run_dir)
    if line:
        print(line)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlcore", description="Fast, pluggable RL post-training for causal LMs.")
    parser.add_argument("--version", action="version", version=f"rlcore {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("RLCORE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, func, helptext in [
        ("train", cmd_train, "train (no arguments: the built-in CPU demo)"),
        ("config", cmd_config, "print the resolved config as YAML"),
        ("validate", cmd_validate, "check config, plugins, data and paths without training"),
    ]:
        p = sub.add_parser(name, help=helptext)
        _add_config_args(p)
        p.set_defaults(func=func, argv=None)
    p = sub.add_parser("plugins", help="list installed plugins, their distribution, version and hooks")
    p.set_defaults(func=cmd_plugins)
    try:
        from rlcore.observe.cli import add_commands
    except ImportError:
        add_commands = None
    if add_commands is not None:
        add_commands(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # overrides after an option (``A=1 --plugins x B=2``) come back here, in order
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    if getattr(args, "argv", "unset") is None:  # what follows the command, for the workers of rlcore's launcher
        args.argv = argv[argv.index(args.command) + 1:]
    os.environ["RLCORE_LOG_LEVEL"] = str(args.log_level)  # workers started by the launcher log alike
    try:
        return int(args.func(args) or 0)
    except RLCoreError as e:
        print(f"rlcore {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
