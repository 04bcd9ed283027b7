"""The ``rlcore`` command: ``train``, ``eval``, ``config``, ``validate``, ``plugins`` (and observability tools).

This module is the argument parser and one function per command; the checks before a model loads are
:mod:`rlcore.preflight`, the demo preset :mod:`rlcore.demo`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from rlcore import __version__
from rlcore.errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_KEYBOARD, EXIT_OK, RLCoreError
from rlcore.preflight import preflight

log = logging.getLogger("rlcore")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "--config_path", "--config-path", dest="config", action="append", default=[],
                   metavar="YAML", help="config file (repeatable; later files override earlier ones)")
    p.add_argument("--plugins", "-p", action="append", default=[], metavar="A,B",
                   help="plugins to load by name from the 'rlcore.plugins' entry-point group")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotlist overrides, e.g. ppo.kl_coeff=0.05")


def resolve(args: argparse.Namespace, *, demo_allowed: bool = True, demo_keys: Optional[Sequence[str]] = None,
            demo_extra: Sequence[str] = ()):
    """Load the config (with the demo preset, plus ``demo_extra``, when applicable) and the list of plugin
    names; sets ``args.demo``. ``demo_keys``: the keys whose presence means the user's own run (default:
    data or a model)."""
    from rlcore.config import load_config
    from rlcore.demo import is_demo, with_demo_preset
    from rlcore.plugin_manager import parse_plugin_names

    given = [n for spec in args.plugins for n in parse_plugin_names(spec)]
    extra = {} if demo_keys is None else {"source_keys": demo_keys}
    args.demo = demo_allowed and is_demo(args.config, args.overrides, given, **extra)
    overrides = with_demo_preset([*demo_extra, *args.overrides]) if args.demo else list(args.overrides)
    cfg = load_config(args.config, overrides)
    names = parse_plugin_names(list(cfg.plugins) + given)
    return cfg, names


def cmd_config(args: argparse.Namespace) -> int:
    from rlcore.config import to_yaml

    cfg, names = resolve(args)
    cfg.plugins = names
    sys.stdout.write(to_yaml(cfg))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    cfg, names = resolve(args)
    from rlcore.demo import demo_tokenizer

    preflight(cfg, names, tokenizer=None if cfg.actor.model_path else demo_tokenizer)
    from rlcore.config.loader import config_warnings

    for warning in config_warnings(cfg):
        log.warning("%s", warning)
    print(f"config OK ({len(names)} plugin(s): {', '.join(names) or 'defaults only'})")
    from rlcore.envs.sandbox import sandbox_level

    print(f"python tool sandbox on this host: {sandbox_level().describe()} (env.python.sandbox: "
          f"{cfg.env.python.sandbox})")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    """Every installed plugin, one row each; one that cannot be imported or registered is a row with
    its error (the command still succeeds: it is how a broken plugin is diagnosed)."""
    from rlcore.errors import PluginError
    from rlcore.plugin_manager import _distribution_of, available_entry_points, available_names, build_plugin_manager

    pm = build_plugin_manager([])
    eps = available_entry_points()
    rows = []
    for name in [n for n in available_names() if not pm.has_plugin(n)]:
        try:
            pm.load([name])
        except PluginError as e:  # the distribution is known from the entry point's metadata alone
            rows.append((name, *_distribution_of(eps.get(name)), "", f"ERROR: {e}"))
    broken = {row[0] for row in rows}  # one that registered and then failed its checks is listed once, as broken
    rows = [(i.name, i.distribution, i.version, "yes" if i.default else "", ", ".join(
        h.replace("rlcore_", "") for h in i.hooks)) for i in pm.infos() if i.name not in broken] + rows
    head = ("name", "distribution", "version", "default", "hooks")
    widths = [max(len(str(r[k])) for r in rows + [head]) for k in range(4)]
    for r in [head] + rows:
        print("  ".join(str(r[k]).ljust(widths[k]) for k in range(4)) + "  " + r[4])
    from rlcore.envs.runner import collect_environments

    envs = collect_environments(pm)

    def usable(plugin: str) -> str:  # default plugins are always loaded; the others only when selected
        return "built in, always available" if plugin in pm.default_names else f"needs --plugins {plugin}"

    print("\nenvironments (data.env_key; settings under plugin_config.<name>):")
    for name, (_, plugin) in sorted(envs.factories.items()):
        print(f"  {name.ljust(16)}  from plugin {plugin} ({usable(plugin)})")
    print("tool-call parsers (env.tool_parser): " + ", ".join(
        name + ("" if envs.parser_plugins.get(name, "defaults") in pm.default_names
                else f" ({usable(envs.parser_plugins[name])})") for name in sorted(envs.parsers)))
    from rlcore import PLUGIN_API_VERSION

    print(f"\nplugin API {PLUGIN_API_VERSION} (rlcore {__version__}; docs/plugins.md, 'Plugin API versions')")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from rlcore.config.inert import inert_keys
    from rlcore.distributed.init import init_distributed
    from rlcore.distributed.launch import maybe_launch

    from rlcore.plugin_checks import provides_data

    cfg, names = resolve(args)
    pm = preflight(cfg, names, build_factories=False)  # the trainer builds (and checks) each factory answer once
    code = maybe_launch(int(cfg.trainer.nproc_per_node), sys.argv[2:] if args.argv is None else list(args.argv))
    if code is not None:
        return code
    split = _world_split(cfg, pm)
    if split is not None and split[1].role == "rollout":
        code = split[0].run_rollout_rank(cfg, split[1], pm)
        split[1].close()
        return code
    dist = split[1].dist if split is not None else init_distributed(cfg.trainer.device)
    if dist.is_main:
        from rlcore.demo import announce, demo_preset_keys

        preset = demo_preset_keys(args.overrides) if args.demo else set()
        world = split[1].world_size if split is not None else dist.world_size  # the whole job, rollout ranks too
        for key, why in inert_keys(cfg, world, ignore=preset):
            log.warning("config key '%s' has no effect in this run: %s", key, why)
        announce(cfg, args.demo, provides_data(pm))
    from rlcore.demo import use_demo_model

    use_demo_model(cfg, dist, provides_data(pm))  # the demo preset's model where actor.model_path is empty
    from rlcore.trainer.loop import Trainer

    trainer = Trainer(cfg, pm, dist, split)
    summary = trainer.train()
    if split is not None:
        split[1].close()
    if dist.is_main:
        print_summary(summary, cfg.trainer.output_dir)
        if trainer.status == "interrupted":
            print(f"run interrupted at step {trainer.state.step} of {cfg.trainer.max_steps}: a checkpoint was saved; "
                  f"the same command with trainer.resume=auto continues it (exit code {EXIT_INTERRUPTED})")
    # Every rank leaves the process group together: a rank that exits with its group alive can be
    # aborted in the communication library's teardown (a failed exit code after a finished run).
    from rlcore.distributed.init import barrier, destroy

    barrier()
    destroy()
    # A graceful stop (SIGINT/SIGTERM, checkpoint saved) is not a success: ``rlcore train && deploy`` must not go on.
    return EXIT_INTERRUPTED if trainer.status == "interrupted" else EXIT_OK


def cmd_eval(args: argparse.Namespace) -> int:
    """Score ``actor.model_path`` on ``data.val_files``: a table on stdout, the report as JSON (``eval.output``)."""
    from rlcore.distributed.init import init_distributed
    from rlcore.errors import ConfigError
    from rlcore.evaluate import DATA_KEYS, DEMO_EVAL_OVERRIDES, Evaluator, format_table, report_path, write_report
    from rlcore.plugin_checks import check_settings
    from rlcore.plugin_manager import build_plugin_manager

    cfg, names = resolve(args, demo_keys=DATA_KEYS, demo_extra=DEMO_EVAL_OVERRIDES)
    if not cfg.actor.model_path:
        final = os.path.join(str(cfg.trainer.output_dir), "final")
        if not args.demo:
            raise ConfigError(["rlcore eval needs the policy to score: set actor.model_path (a Hugging Face model "
                               "directory or an rlcore checkpoint)"])
        if not os.path.isdir(final):
            raise ConfigError([f"rlcore eval: no trained demo policy in {final}: run `rlcore train` first, or set "
                               "actor.model_path"])
        cfg.actor.model_path = final
    pm = build_plugin_manager(names)
    check_settings(pm, cfg)  # configures each plugin with its settings
    dist = init_distributed(cfg.trainer.device)
    report = Evaluator(cfg, pm, dist).run()
    if dist.is_main:
        path = report_path(cfg)
        write_report(report, path)
        ev = report["eval"]
        print(f"\n=== rlcore eval: {report['model']} ===\n{ev['n']} sample(s) a prompt, temperature "
              f"{ev['temperature']:g}, pass = reward >= {ev['pass_threshold']:g}")
        print(format_table(report))
        print(f"report: {path}")
    return EXIT_OK


def _world_split(cfg, pm):
    """``(answer, SplitInfo)`` when a plugin splits this job into training and rollout ranks
    (``rlcore_world_split``), after joining the groups; else ``None``."""
    from omegaconf import OmegaConf

    from rlcore.distributed.init import env_int, init_split

    answer = pm.build("rlcore_world_split", world_size=env_int("WORLD_SIZE", 1),
                      config=OmegaConf.to_container(cfg, resolve=True))
    if not int(answer.rollout_ranks):
        return None
    return answer, init_split(cfg.trainer.device, int(answer.rollout_ranks), str(answer.weights_backend))


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


EXIT_CODES_HELP = f"""exit codes:
  {EXIT_OK}    the run completed (and exported final/ when trainer.export_final)
  {EXIT_INTERRUPTED}   stopped early by SIGTERM/SIGINT after saving a checkpoint;
       the same command with trainer.resume=auto continues it
  {EXIT_ERROR}    an error was reported (config, data, checkpoint, reward, training diverged)
  1    an unexpected failure (a traceback is printed)
  {EXIT_KEYBOARD}  stopped at once by a second Ctrl-C, without a checkpoint of the current step"""
def cmd_convert_config(args: argparse.Namespace) -> int:
    """Write the rlcore equivalent of a verl or TRL config; list every key that has no counterpart."""
    from rlcore.convert import convert

    conv = convert(args.source, args.file, list(args.overrides))
    text = conv.to_yaml(args.file)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
    from rlcore.convert_knobs import unmapped_summary

    print(f"rlcore convert-config: {len(conv.mapped)} key(s) mapped, {len(conv.unmapped)} without an rlcore "
          f"counterpart, by reason (each key is listed in the output's header; see docs/migrating.md):",
          file=sys.stderr)
    for line in unmapped_summary(conv.unmapped):
        print(line, file=sys.stderr)
    for note in conv.notes:
        print(f"  note: {note}", file=sys.stderr)
    if args.output:
        print(f"written to {args.output}; check it with: rlcore validate --config {args.output}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlcore", description="Fast, pluggable RL post-training for causal LMs.")
    parser.add_argument("--version", action="version", version=f"rlcore {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("RLCORE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, func, helptext in [
        ("train", cmd_train, "train (no arguments: the built-in CPU demo)"),
        ("config", cmd_config, "print the resolved config as YAML"),
        ("validate", cmd_validate, "check config, plugins, data and paths without training"),
        ("eval", cmd_eval, "score a policy on held-out prompts: pass@k, mean reward, lengths per data_source "
                           "(no arguments: the demo's trained policy)"),
    ]:
        extra = {"epilog": EXIT_CODES_HELP, "formatter_class": argparse.RawDescriptionHelpFormatter} \
            if name == "train" else {}
        p = sub.add_parser(name, help=helptext, **extra)
        _add_config_args(p)
        p.set_defaults(func=func, argv=None)
    p = sub.add_parser("convert-config", help="turn a verl trainer config or a TRL GRPOConfig into an rlcore config")
    p.add_argument("--from", dest="source", required=True, choices=["verl", "trl"], help="the source framework")
    p.add_argument("file", metavar="FILE", help="verl: the trainer YAML; trl: a GRPOConfig saved as YAML or JSON")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="the run script's overrides in the source's own keys (e.g. algorithm.adv_estimator=grpo)")
    p.add_argument("-o", "--output", metavar="YAML", help="write here instead of standard output")
    p.set_defaults(func=cmd_convert_config)
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
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_KEYBOARD
