"""Start-up checks of the selected plugins that need no model: their settings, the rollout backend
name, and the answers of the factory hooks the trainer builds before a model loads (two selected
plugins answering one hook, an answer lacking a method of its protocol).

The checks ask the plugins; none names a plugin of its own.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
from typing import Any, Callable, Optional

from omegaconf import DictConfig, OmegaConf

from rlcore.errors import PluginError
from rlcore.hookspecs import FACTORY_HOOKS
from rlcore.plugin_manager import close_answer, provides_data  # noqa: F401 - provides_data: where the CLI finds it

log = logging.getLogger(__name__)

#: ``actor.rollout_backend`` values the built-in plugins answer to.
BUILTIN_ROLLOUT_BACKENDS = ("auto", "engine", "hf")


def check_settings(pm: Any, cfg: DictConfig) -> None:
    """``plugin_config.<name>`` of every registered plugin against the schema it declares."""
    pm.configure(OmegaConf.to_container(cfg.plugin_config, resolve=True))


def check_rollout_backend(pm: Any, cfg: DictConfig) -> None:
    """``actor.rollout_backend`` names a backend some plugin answers, before any model loads: a
    built-in name, the name of a selected plugin implementing ``rlcore_rollout_backend`` (a backend
    plugin answers for its own name), or a name such a plugin answers when asked with a tiny model
    built in memory (nothing is loaded or written). With ``data.env_key`` (multi-turn episodes) a
    plugin's backend is asked so in any case, and one that does not declare ``supports_episodes = True``
    is refused.

    :raises PluginError: naming the value, the known backends and the closest of them; or naming the
        plugin whose backend cannot play the run's episodes.
    """
    name = str(cfg.actor.rollout_backend)
    if name in BUILTIN_ROLLOUT_BACKENDS:
        return
    providers = [n for n in pm.selected_names if _implements(pm, n, "rlcore_rollout_backend")]
    episodes = bool(cfg.data.env_key)
    probe = _probe_backend(pm, cfg, name, providers) if providers and (episodes or name not in providers) else None
    if probe is not None or name in providers:
        if episodes and probe is not None and probe[1] is False:
            from rlcore.contract import refuse_episodes

            raise refuse_episodes(probe[0], probe[2])
        return
    known = list(BUILTIN_ROLLOUT_BACKENDS) + providers
    close = difflib.get_close_matches(name, known, n=1)
    why = (f"no selected plugin answers it (asked {', '.join(repr(p) for p in providers)})" if providers else
           "no selected plugin builds rollout backends (rlcore_rollout_backend)")
    raise PluginError(f"actor.rollout_backend={name!r}: {why}; the known backends are {', '.join(known)}"
                      + (f" (did you mean {close[0]!r}?)" if close else "")
                      + ("" if providers else "; or select the plugin that provides it with --plugins"))


def _probe_backend(pm: Any, cfg: DictConfig, name: str, providers: list[str]) -> Optional[tuple[str, Any, Any]]:
    """``(plugin, supports_episodes, backend)`` of the first of ``providers`` that answers
    ``rlcore_rollout_backend`` for ``name``, asked as the trainer asks (``data.env_key`` included) with a
    tiny random model (nothing is loaded or written; the answer is closed at once); ``supports_episodes``
    is None for a plugin that raised while building (it tried: the name is its; the trainer reports the
    error). None: no provider answers."""
    from rlcore.protocols import DistInfo
    from rlcore.rollout.tiny import tiny_causal_lm
    from rlcore.trainer.generation import rollout_request

    request = dataclasses.replace(rollout_request(obj(cfg.actor), obj(cfg.data), obj(cfg.ppo)), backend=name)
    model = tiny_causal_lm("qwen2")
    for provider in providers:
        try:
            answer = _call_alone(pm, provider, "rlcore_rollout_backend",
                                 dict(model=model, request=request, dist=DistInfo()))
        except Exception:  # noqa: BLE001 - it tried to build one: the name is its
            return provider, None, None
        if answer is not None:
            close_answer(answer)
            return provider, bool(getattr(answer, "supports_episodes", False)), answer
    return None


def check_conflicts(pm: Any, cfg: DictConfig, world_size: int,
                    tokenizer: Optional[Callable[[], Any]] = None) -> None:
    """Build, as ``rlcore train`` would, every factory hook that a selected plugin implements and
    that the trainer calls before a model loads, each selected plugin asked on its own, and check
    the answers as ``train`` does: two selected plugins answering one hook, and an answer lacking a
    method of its protocol (:func:`rlcore.plugin_manager.check_answer`), are each a
    :class:`PluginError`, and all are reported together (a :class:`~rlcore.errors.PreflightError`
    when more than one). An error a factory raises itself is reported too when the world size is
    known before start (``WORLD_SIZE``, ``trainer.nproc_per_node`` > 1); otherwise it is left to
    ``train``, whose answer may depend on the world size it has. Each plugin is asked once per call
    (the reward backend receives the placement answer already built) and every answer is closed at the
    end (``close()`` where it has one). Hooks only the built-in defaults answer are not built; a reward
    backend is not built while ``reward_model.enable`` is set (it would load the reward model). The
    rollout backend needs the model: its answer is checked when the model has loaded.

    :param tokenizer: loads the tokenizer the dataset and reward hooks receive (default: the actor's,
        from ``actor.model_path``; ``rlcore validate`` without a model gives the demo's, built in a
        temporary directory, so nothing is written to ``trainer.output_dir``).
    """
    from rlcore.distributed.init import known_world_size
    from rlcore.errors import PreflightError, RLCoreError
    from rlcore.protocols import DistInfo

    dist = DistInfo(world_size=max(1, world_size))
    hooks = [h for h in FACTORY_HOOKS if h != "rlcore_rollout_backend"
             and any(_implements(pm, n, h) for n in pm.selected_names)]
    if cfg.reward_model.enable and "rlcore_reward_backend" in hooks:
        hooks.remove("rlcore_reward_backend")
    if not hooks:
        return
    world_known = known_world_size(cfg.trainer.nproc_per_node) is not None
    built: dict[str, list[Any]] = {}  # per hook, the answers built: each factory is asked once, closed at the end
    args = _factory_args(pm, cfg, dist, _tokenizer_loader(cfg, tokenizer), built)
    problems: list[RLCoreError] = []
    try:
        _ask_each(pm, hooks, args, built, problems, world_known)
    finally:
        for answers in built.values():
            for answer in answers:
                close_answer(answer)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        raise PreflightError(problems)


def _ask_each(pm: Any, hooks: list[str], args: dict, built: dict[str, list[Any]], problems: list,
              world_known: bool) -> None:
    """Ask each selected plugin implementing each of ``hooks`` on its own, record its answer in
    ``built`` and every problem in ``problems`` (once each)."""
    from rlcore.errors import RLCoreError
    from rlcore.plugin_manager import check_answer

    def report(error: RLCoreError) -> None:  # once: the dataset hook is asked per split
        if str(error) not in {str(p) for p in problems}:
            problems.append(error)

    def failed(plugin: Optional[str], hook: str, error: Exception) -> None:
        if not world_known:
            log.debug("building %s for a check failed (left to train): %s", hook, error)
        elif isinstance(error, RLCoreError):
            report(error)
        else:
            report(PluginError(f"plugin '{plugin}': {hook} failed: {type(error).__name__}: {error}"))

    for hook in hooks:
        try:
            calls = args[hook]()
        except Exception as error:  # noqa: BLE001 - building the arguments (the reward's placement)
            failed(None, hook, error)
            continue
        for kwargs in calls:
            answers = []
            for name in [n for n in pm.selected_names if _implements(pm, n, hook)]:
                try:
                    answer = _call_alone(pm, name, hook, kwargs)
                except Exception as error:  # noqa: BLE001 - reported (or left to train) above
                    failed(name, hook, error)
                    continue
                if answer is not None:
                    answers.append((name, answer))
                    built.setdefault(hook, []).append(answer)
            if len(answers) > 1:
                report(PluginError(f"plugins '{answers[0][0]}' and '{answers[1][0]}' both answer {hook}; "
                                   "select only one of them"))
            for name, answer in answers:
                try:
                    check_answer(hook, name, answer)
                except PluginError as error:
                    report(error)


def _call_alone(pm: Any, name: str, hook: str, kwargs: dict) -> Any:
    """Plugin ``name``'s answer to factory hook ``hook`` (None: it passes), through pluggy as the
    trainer calls it."""
    plugin = pm.get_plugin(name)
    result = pm.subset_hook_caller(hook, remove_plugins=[p for p in pm.get_plugins() if p is not plugin])(**kwargs)
    return result[0] if result else None


def _tokenizer_loader(cfg: DictConfig, given: Optional[Callable[[], Any]]) -> Callable[[], Any]:
    """The tokenizer the factory hooks receive, loaded once on first use: ``given``, else the actor's
    (``actor.model_path``; a :class:`~rlcore.errors.ConfigError` naming it where it is empty)."""
    @functools.cache
    def load() -> Any:
        if given is not None:
            return given()
        if not cfg.actor.model_path:
            from rlcore.errors import ConfigError

            raise ConfigError(["actor.model_path is not set: the factory hooks receive the actor's tokenizer"])
        from rlcore.trainer.models import load_tokenizer

        return load_tokenizer(cfg.actor.model_path)

    return load


def _implements(pm: Any, name: str, hook: str) -> bool:
    return pm.implements(name, hook)


def obj(node: Any) -> Any:
    """The typed dataclass object of a config section (what a factory receives)."""
    return OmegaConf.to_object(node)


def _factory_args(pm: Any, cfg: DictConfig, dist: Any, tokenizer: Optional[Callable[[], Any]],
                  built: Optional[dict[str, list[Any]]] = None) -> dict:
    """Per factory hook, a function giving the keyword arguments of each call ``train`` makes; the
    reward's placement is the placement policy already in ``built`` (else built once here, recorded there)."""
    built = {} if built is None else built
    from rlcore.config.schema import resolve_fsdp, trains_critic
    from rlcore.distributed.placement import requested_devices
    from rlcore.protocols import PlacementRequest

    def placement_args() -> list[dict]:
        devices = requested_devices(obj(cfg.actor), obj(cfg.critic), obj(cfg.reward_model),
                                    trains_critic(cfg.algorithm.adv_estimator))
        request = PlacementRequest(**devices, reward_offload=bool(cfg.reward_model.offload),
                                   rank_groups={r: list(g) for r, g in cfg.placement.rank_groups.items()})
        return [dict(request=request, dist=dist)]

    def tok() -> Any:
        return tokenizer() if tokenizer is not None else None

    def dataset_args() -> list[dict]:
        data = obj(cfg.data)
        splits = ["train"] + (["val"] if data.val_files or not data.train_files else [])  # as train asks
        return [dict(config=data, tokenizer=tok(), split=split, dist=dist) for split in splits]

    def placement() -> Any:
        if built.get("rlcore_placement_policy"):
            return built["rlcore_placement_policy"][0]
        answer = _placement()
        built.setdefault("rlcore_placement_policy", []).append(answer)
        return answer

    def _placement() -> Any:
        try:
            return pm.build("rlcore_placement_policy", **placement_args()[0])
        except PluginError:  # reported under its own hook; the reward's factory gets a selected answer to go on
            for name in [n for n in pm.selected_names if _implements(pm, n, "rlcore_placement_policy")]:
                answer = _call_alone(pm, name, "rlcore_placement_policy", placement_args()[0])
                if answer is not None:
                    return answer
            raise

    def reward_args() -> list[dict]:
        placement_policy = placement()
        rewards: dict[str, Any] = {}
        pm.hook.rlcore_register_rewards(register=lambda name, fn: rewards.__setitem__(name, fn))
        return [dict(reward_model=obj(cfg.reward_model), reward_function=obj(cfg.custom_reward_function),
                     reward=obj(cfg.reward), placement=placement_policy, tokenizer=tok(), rewards=rewards,
                     run_dir=cfg.trainer.output_dir)]

    return {
        "rlcore_placement_policy": placement_args,
        "rlcore_dataset_provider": dataset_args,
        "rlcore_reward_backend": reward_args,
        "rlcore_checkpoint_policy": lambda: [dict(trainer=obj(cfg.trainer), dist=dist)],
        "rlcore_world_split": lambda: [dict(world_size=dist.world_size, config=OmegaConf.to_container(cfg, resolve=True))],
        "rlcore_reshard_policy": lambda: [dict(fsdp=resolve_fsdp(obj(cfg.fsdp), obj(cfg.actor.fsdp)),
                                               remeshing=obj(cfg.actor.remeshing), dist=dist)],
    }
