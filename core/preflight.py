"""Every check that can run before a model loads (``rlcore validate``, and ``rlcore train`` before it
starts): plugins and their settings, data files, model and reward-model paths, role devices, the
output directory, the checkpoint to resume from, the reward function, each plugin's own checks, the
environments the data names (``data.env_key``) and the ``python`` environment's sandbox level
(``env.python.sandbox``), rank groups, and two plugins answering one factory
hook."""

from __future__ import annotations

from rlcore.errors import RLCoreError


def preflight(cfg, names, build_factories: bool = True, tokenizer=None):
    """Every check that can run before a model loads: plugins and their settings, data files, model and
    reward-model paths, role devices, output directory, the checkpoint to resume from, the reward
    function, each plugin's own checks (``rlcore_preflight``: plugin requirements, shard sizes), rank
    groups, and — when the rest is sound and ``build_factories`` — two selected plugins answering the
    same factory hook and answers lacking a method (``rlcore validate``). ``rlcore train`` leaves those to
    the trainer, which builds every factory answer once, before any model loads, and checks it there
    (building them here too would build each twice). Every problem found is reported together.

    :param tokenizer: loads the tokenizer the factory hooks receive (default: the actor's, from
        ``actor.model_path``; ``rlcore validate`` without a model gives the demo preset's).
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
    from rlcore.config.loader import to_container
    from rlcore.plugin_checks import check_conflicts, check_rollout_backend, check_settings

    attempt(check_settings, pm, cfg)
    attempt(check_rollout_backend, pm, cfg)
    given = {"config": to_container(cfg), "plugins": list(names)}
    for impl in pm.hook.rlcore_preflight.get_hookimpls():  # each plugin's checks, all reported
        attempt(_plugin_check, impl, given)
    attempt(_check_environments, cfg, pm)
    attempt(_check_rank_groups, cfg)
    if not problems and build_factories:  # two plugins answering one factory hook, found as train would find it
        attempt(check_conflicts, pm, cfg, _world_size(cfg), tokenizer)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise PreflightError(problems)
    return pm


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
    # Columns are known for local parquet files (their footers) and jsonl files (every record); remote
    # files are not opened here, so those leave the check to the first batch.
    if train_files and all(info.format in ("parquet", "jsonl") and info.columns for info in train_files):
        columns = set.intersection(*(set(info.columns) for info in train_files))
        check_arguments(reward, fn.name, sorted(columns), list(fn.kwargs or {}))


def _check_environments(cfg, pm) -> None:
    """With ``data.env_key``: the tool-call parser exists, every environment configured under
    ``plugin_config`` builds from its settings (a bad key fails here, naming it), and every
    environment the data files name in that column is registered (local parquet and jsonl files;
    only that column is read)."""
    if not cfg.data.env_key:
        return
    from omegaconf import OmegaConf

    from rlcore.envs.runner import check_data_environments, collect_environments
    from rlcore.errors import EnvError

    from rlcore.envs.builtin import with_sandbox_mode

    plugin_config = with_sandbox_mode(OmegaConf.to_container(cfg.plugin_config, resolve=True),
                                      cfg.env.python.sandbox)
    envs = collect_environments(pm, plugin_config, cfg.env.tool_parser)
    if cfg.env.tool_parser not in envs.parsers:
        raise EnvError(f"env.tool_parser: '{cfg.env.tool_parser}' is not a registered tool-call parser; parsers: "
                       f"{', '.join(sorted(envs.parsers))}")
    for name in cfg.plugin_config:
        if name in envs.factories:
            envs.limits(name)
            try:
                _close_env(envs.make(name))  # built only to try its settings: never started, closed at once
            except ValueError as error:
                raise EnvError(f"environment '{name}': {error}") from error
    files = _data_files(cfg)
    check_data_environments(envs, files, str(cfg.data.env_key), pm.default_names + pm.selected_names)
    _check_python_sandbox(cfg, files)


def _check_python_sandbox(cfg, files) -> None:
    """``env.python.sandbox: strict`` where the data names the ``python`` environment (the first file
    and row that does) and this host cannot give its code a strict sandbox."""
    from rlcore.envs.builtin import check_python_sandbox
    from rlcore.envs.runner import environments_in_file

    for key, path in files:
        where = environments_in_file(path, str(cfg.data.env_key)).get("python")
        if where is not None:
            check_python_sandbox(str(cfg.env.python.sandbox), f"{key}: {path} {where}")
            return


def _close_env(env) -> None:
    """``env.close()`` (plain or ``async``), where the environment has one."""
    import asyncio
    import inspect

    close = getattr(env, "close", None)
    if callable(close):
        out = close()
        if inspect.isawaitable(out):
            asyncio.run(out)


def _data_files(cfg) -> list[tuple[str, str]]:
    """``(config key, path)`` of the local parquet and jsonl training and held-out files the default
    dataset provider reads (none with ``data.custom_cls``; files that are missing are reported by
    the data check)."""
    from rlcore.data.files import file_format, is_remote, resolve_files
    from rlcore.errors import DataError

    if cfg.data.custom_cls.path:
        return []
    out = []
    for key in ("train_files", "val_files"):
        try:
            paths = resolve_files(cfg.data[key], f"data.{key}")
        except DataError:
            continue
        out += [(f"data.{key}", p) for p in paths if not is_remote(p) and file_format(p)]
    return out


def _check_devices(cfg) -> None:
    """Each role's ``device`` names a device this machine has (the roles this run uses)."""
    import torch

    from rlcore.config.schema import trains_critic
    from rlcore.distributed.placement import DEVICE_KEYS, parse_device, requested_devices

    from rlcore.distributed.init import check_device_pref
    from rlcore.trainer.models import check_attn_implementation

    check_device_pref(str(cfg.trainer.device))

    devices = requested_devices(cfg.actor, cfg.critic, cfg.reward_model, trains_critic(cfg.algorithm.adv_estimator))
    local = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    for role, spec in devices.items():
        device = parse_device(str(spec), local, DEVICE_KEYS[role])
        if role in ("actor", "critic") and (role == "actor" or trains_critic(cfg.algorithm.adv_estimator)):
            check_attn_implementation(cfg[role].attn_implementation, device, f"{role}.attn_implementation")


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


def _world_size(cfg) -> int:
    """Processes of the run as known before any starts: torchrun's ``WORLD_SIZE``, else ``trainer.nproc_per_node``."""
    from rlcore.distributed.init import env_int

    return env_int("WORLD_SIZE", 0) or int(cfg.trainer.nproc_per_node or 1)


def _to_object(node):
    from omegaconf import OmegaConf

    return OmegaConf.to_object(node)
