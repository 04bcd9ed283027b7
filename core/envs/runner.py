"""Driving episodes during a rollout: environment calls off the decoding loop, observation rendering.

A rollout backend that meets a turn end hands the turn to :meth:`EpisodeRunner.submit` and goes on
decoding its other sequences; the runner's event loop (one background thread) calls the
environment (coroutines concurrently, plain functions in worker threads), renders the
observation with the tokenizer's chat template and tokenizes it there, and resolves a future with
the tokens to append (or ``None`` when the episode is over). The backend polls the futures
between decode steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from rlcore.envs.base import LIMIT_KEYS, Step, Turn
from rlcore.envs.guards import DaemonThreads, cap_observation, message_problem, step_problem
from rlcore.errors import EnvError, RLCoreError
from rlcore.rollout.turns import episodes_of  # noqa: F401 - read here by the backends; beside play_episodes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode limits and how turns end (the ``env`` section, refined per environment)."""

    max_turns: int = 4
    #: tokens after the prompt (model and observation tokens); None = the rollout's max_new_tokens
    max_tokens: Optional[int] = None
    #: seconds a call of the environment (``start``, ``step``, ``close``) may take
    timeout_s: float = 60.0
    #: characters of an observation rendered and tokenized (the rest is cut off)
    max_observation_chars: int = 32768


class Episode:
    """One episode: its environment, the row it started from, and what happened."""

    def __init__(self, name: str, env: Any, row: dict, limits: EpisodeLimits, runner: "EpisodeRunner"):
        self.name, self.env, self.row, self.limits, self.runner = name, env, row, limits, runner
        self.turns = 0
        self.reward: Optional[float] = None
        self.done = False
        self.truncated = False
        self.timed_out = False
        self.env_seconds = 0.0
        self.model_tokens = 0
        self.observation_tokens = 0
        self.metrics: dict[str, float] = {}
        self.closed = False

    def token_limit(self, max_new_tokens: int) -> int:
        """The response tokens (model and observation tokens together) this episode may hold:
        ``max_tokens`` of its limits (``env.max_tokens``, or ``plugin_config.<name>.max_tokens``),
        at most ``max_new_tokens``. A backend ends the episode's turn there: the turn the model is
        writing after ``used`` tokens may take ``token_limit(max_new_tokens) - used`` more."""
        cap = int(max_new_tokens)
        return cap if self.limits.max_tokens is None else max(0, min(cap, int(self.limits.max_tokens)))

    def turn_ended(self, token_ids: Sequence[int], used: int, budget: int,
                   truncated: bool = False) -> "concurrent.futures.Future":
        """The model's turn ``token_ids`` ended with ``used`` response tokens so far (of ``budget``):
        a future of the observation's token ids to append, or ``None`` when the episode is over."""
        return self.runner.submit(self, list(token_ids), used, budget, truncated)


@dataclass
class Environments:
    """The environments plugins registered (name -> factory, plugin) and their settings."""

    factories: dict[str, tuple[Callable[[dict], Any], str]]
    plugin_config: dict[str, Any] = field(default_factory=dict)
    parsers: dict[str, Callable[[str], Any]] = field(default_factory=dict)
    tool_parser: str = "hermes"
    defaults: EpisodeLimits = EpisodeLimits()
    #: the plugin that registered each parser
    parser_plugins: dict[str, str] = field(default_factory=dict)

    def check_names(self, names: Sequence[Any], where: str) -> None:
        """Raise naming the first unknown environment in ``names`` (``None``/empty means no environment)."""
        import difflib

        for name in names:
            if name in (None, "") or name in self.factories:
                continue
            near = difflib.get_close_matches(str(name), list(self.factories), n=1)
            raise EnvError(f"{where}: environment '{name}' is not registered"
                           + (f" (did you mean '{near[0]}'?)" if near else "")
                           + f"; registered environments: {', '.join(sorted(self.factories)) or 'none'}")

    def limits(self, name: str) -> EpisodeLimits:
        """The limits of ``name``'s episodes: the ``env`` section's, with ``plugin_config.<name>``'s
        ``max_turns`` and ``max_tokens`` over them.

        :raises EnvError: a value that is not a positive whole number, naming its key."""
        cfg = dict(self.plugin_config.get(name) or {})
        base = self.defaults
        values = {}
        for key in LIMIT_KEYS:
            value = cfg.get(key, getattr(base, key))
            if value is not None and key in cfg:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise EnvError(f"plugin_config.{name}.{key}: {value!r} is not a positive whole number")
            values[key] = value
        return EpisodeLimits(max_turns=int(values["max_turns"]), max_tokens=values["max_tokens"],
                             timeout_s=base.timeout_s, max_observation_chars=base.max_observation_chars)

    def make(self, name: str) -> Any:
        """A fresh environment ``name`` for one episode, configured by ``plugin_config.<name>``."""
        from rlcore.envs.tools import ToolEnvironment

        factory, plugin = self.factories[name]
        cfg = {k: v for k, v in dict(self.plugin_config.get(name) or {}).items() if k not in LIMIT_KEYS}
        try:
            env = factory(cfg)
        except RLCoreError:
            raise
        except Exception as error:
            raise EnvError(f"environment '{name}' (plugin '{plugin}') could not be built from "
                           f"plugin_config.{name}: {type(error).__name__}: {error}") from error
        if isinstance(env, ToolEnvironment):
            if self.tool_parser not in self.parsers:
                raise EnvError(f"env.tool_parser: '{self.tool_parser}' is not a registered tool-call parser; "
                               f"parsers: {', '.join(sorted(self.parsers))}")
            env.parser = self.parsers[self.tool_parser]
        return env


def collect_environments(pm: Any, plugin_config: Optional[dict] = None, tool_parser: str = "hermes",
                         defaults: EpisodeLimits = EpisodeLimits()) -> Environments:
    """Every environment and tool-call parser the loaded plugins register (``rlcore_environment``,
    ``rlcore_tool_parser``); the same name from two plugins is an error naming both."""
    factories: dict[str, tuple[Callable, str]] = {}
    parsers: dict[str, Callable] = {}
    for hook, table, what in (("rlcore_environment", factories, "environment"),
                              ("rlcore_tool_parser", parsers, "tool-call parser")):
        for impl in getattr(pm.hook, hook).get_hookimpls():
            def register(name, fn, _plugin=impl.plugin_name, _table=table, _what=what, _hook=hook):
                if not callable(fn):
                    raise EnvError(f"plugin '{_plugin}' registered {_what} '{name}' that is not callable")
                if name in _table and _table[name][1] != _plugin:
                    raise EnvError(f"{_what} '{name}' is registered by two plugins: '{_table[name][1]}' and "
                                   f"'{_plugin}'")
                _table[name] = (fn, _plugin)
            impl.function(register=register)
    return Environments(factories, dict(plugin_config or {}), {k: v[0] for k, v in parsers.items()}, tool_parser,
                        defaults, {k: v[1] for k, v in parsers.items()})


def installed_providers(loaded: Sequence[str]) -> dict[str, str]:
    """Environment name -> the installed plugin, not among ``loaded``, that registers it. Every such
    plugin is imported (one that fails to import or to register is skipped): call it to explain a
    name no loaded plugin has, not on every run."""
    from rlcore.plugin_manager import RLCorePluginManager, available_names

    pm = RLCorePluginManager()
    out: dict[str, str] = {}
    for plugin in available_names():
        if plugin in loaded:
            continue
        try:
            pm.load([plugin])
        except Exception:  # noqa: BLE001 - `rlcore plugins` shows why a plugin does not load
            continue
        for impl in pm.hook.rlcore_environment.get_hookimpls():
            if impl.plugin_name == plugin:
                try:
                    impl.function(register=lambda name, _fn, _p=plugin: out.setdefault(str(name), _p))
                except Exception:  # noqa: BLE001 - as above
                    continue
    return out


def environments_in_file(path: str, column: str) -> dict[str, str]:
    """The distinct environment names in ``column`` of a local parquet or jsonl file, each with where
    it first appears (``"row 3"``, 0-based like the data pipeline's rows; jsonl adds the line);
    empty values (no environment) are left out. Parquet: only that column is read, a batch at a
    time; jsonl: one streaming pass. A file without the column names none.

    :raises DataError: a parquet file that cannot be read, naming it."""
    import json

    from rlcore.errors import DataError

    found: dict[str, str] = {}
    if path.lower().endswith((".parquet", ".pq")):
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
            if column not in pf.schema_arrow.names:
                return found
            offset = 0
            for batch in pf.iter_batches(columns=[column], batch_size=1 << 16):
                values = batch.column(0)
                try:
                    distinct = pc.unique(values).to_pylist()
                except pa.ArrowNotImplementedError:  # a nested column: compared as Python values
                    distinct = values.to_pylist()
                for value in distinct:
                    if value in (None, "") or str(value) in found:
                        continue
                    try:
                        first = int(pc.index(values, value).as_py())
                    except (pa.ArrowException, TypeError):
                        first = values.to_pylist().index(value)
                    found[str(value)] = f"row {offset + first}"
                offset += batch.num_rows
        except (OSError, pa.ArrowException) as err:
            raise DataError(f"{path}: cannot read column '{column}' (data.env_key): {type(err).__name__}: "
                            f"{err}") from err
        return found
    row = 0
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:  # the data check reports it
                record = None
            value = record.get(column) if isinstance(record, dict) else None
            if value not in (None, "") and str(value) not in found:
                found[str(value)] = f"row {row} (line {lineno})"
            row += 1
    return found


def check_data_environments(environments: Environments, files: Sequence[tuple[str, str]], column: str,
                            loaded: Sequence[str]) -> None:
    """Every environment named in ``column`` (``data.env_key``) of ``files`` (``(config key, path)``
    pairs of local parquet/jsonl files) is registered.

    :raises EnvError: one line per unknown name, with the file and the first row naming it, and the
        installed plugin to select with ``--plugins`` when one registers it (else near names)."""
    import difflib

    unknown: dict[str, tuple[str, str, str]] = {}
    for key, path in files:
        for name, where in environments_in_file(path, column).items():
            if name not in environments.factories and name not in unknown:
                unknown[name] = (key, path, where)
    if not unknown:
        return
    providers = installed_providers(loaded)
    registered = sorted(environments.factories)
    lines = []
    for name, (key, path, where) in unknown.items():
        line = f"{key}: {path} {where} names environment '{name}' (column '{column}', data.env_key), which no " \
               "selected plugin registers"
        if name in providers:
            line += f"; the installed plugin '{providers[name]}' registers it: select it with " \
                    f"--plugins {providers[name]}"
        else:
            near = difflib.get_close_matches(name, registered, n=1)
            line += (f" (did you mean '{near[0]}'?)" if near else "") \
                + f"; registered environments: {', '.join(registered) or 'none'}"
        lines.append(line)
    raise EnvError("\n".join(lines))


# ------------------------------------------------------------------------------------ rendering

class ObservationRenderer:
    """Turns an environment's observation into token ids to append after the model's turn.

    With a chat template: the text the template puts after an assistant message when the
    observation messages follow it, with the generation prompt of the next assistant turn (found
    as the difference of two renderings), preceded by the template's end of an assistant turn
    when the turn ended on a stop string instead of EOS. Without a chat template: the messages'
    contents on lines of their own (a tool result inside ``<tool_response>``).
    """

    def __init__(self, tokenizer: Any, default_role: str = "user"):
        self.tok = tokenizer
        self.default_role = default_role
        self.template = bool(getattr(tokenizer, "chat_template", None))
        eos = tokenizer.eos_token_id
        self.eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        self.closing = ""
        if self.template:
            marker = "\u2063reply\u2063"
            base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}]
            text = tokenizer.apply_chat_template(base, tokenize=False)
            self.closing = text[text.index(marker) + len(marker):] if marker in text else ""
            self._base = base

    def messages(self, observation: Any, role: str) -> list[dict]:
        if observation is None:
            return []
        if isinstance(observation, str):
            return [{"role": role, "content": observation}]
        if isinstance(observation, dict):
            return [observation]
        return [dict(m) for m in observation]

    def text(self, messages: list[dict], ended_on_eos: bool) -> str:
        from rlcore.envs.tools import tool_response

        if not self.template:
            return "\n" + "\n".join(tool_response(m["content"]) if m.get("role") == "tool" else str(m["content"])
                                    for m in messages) + "\n"
        tok = self.tok
        before = tok.apply_chat_template(self._base, tokenize=False)
        after = tok.apply_chat_template(self._base + messages, tokenize=False, add_generation_prompt=True)
        common = 0
        while common < min(len(before), len(after)) and before[common] == after[common]:
            common += 1
        # the model's EOS ends its turn; what the template adds after it (a newline) is context
        closing = self.closing
        eos_text = tok.decode(sorted(self.eos_ids)[:1]) if self.eos_ids else ""
        if ended_on_eos and eos_text and closing.startswith(eos_text):
            closing = closing[len(eos_text):]
        # ``after`` repeats ``before`` up to the end of the assistant message (the closing included)
        end_of_reply = before.index(self.closing, before.index("\u2063reply\u2063")) if self.closing else common
        return closing + after[max(common, end_of_reply + len(self.closing)):]

    def ids(self, observation: Any, role: str, ended_on_eos: bool) -> list[int]:
        messages = self.messages(observation, role)
        if not messages:
            return []
        return list(self.tok(self.text(messages, ended_on_eos), add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------------------------ the runner

class EpisodeRunner:
    """Starts episodes and answers their turns on a background event loop.

    Args:
        environments: the registry (:func:`collect_environments`).
        tokenizer: the actor's tokenizer (decoding turns, rendering observations).
        max_concurrency: environment calls running at once (coroutines and worker threads).
    """

    def __init__(self, environments: Environments, tokenizer: Any, max_concurrency: int = 64,
                 stop: Sequence[str] = ("</tool_call>",)):
        self.environments = environments
        self.tok = tokenizer
        self.stop = [s for s in stop if s]
        self._stops = None
        self.renderer = ObservationRenderer(tokenizer)
        self.max_concurrency = max(1, int(max_concurrency))
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._pool = None
        self._lock = threading.Lock()

    def stops(self) -> tuple[set[int], list[str]]:
        """Stop strings as one-token ids (flagged on the device with EOS) and longer texts."""
        if self._stops is None:
            from rlcore.rollout.turns import stop_token_ids

            self._stops = stop_token_ids(self.tok, self.stop)
        return self._stops

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    # -- the loop thread
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._pool = DaemonThreads()
                loop.set_default_executor(self._pool)
                self._thread = threading.Thread(target=loop.run_forever, name="rlcore-env-loop", daemon=True)
                self._thread.start()
                self._loop = loop
                self._sem = None
            return self._loop

    async def _call(self, fn: Callable, *args) -> Any:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrency)
        async with self._sem:
            if inspect.iscoroutinefunction(fn):
                return await fn(*args)
            out = await asyncio.get_running_loop().run_in_executor(None, fn, *args)
            if inspect.isawaitable(out):
                out = await out
            return out

    def close(self) -> None:
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5.0)
            loop.close()
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __del__(self):  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at interpreter exit
            pass

    # -- episodes
    def start(self, names: Sequence[Optional[str]], rows: Sequence[dict]) -> list[Optional[Episode]]:
        """Build and start one episode per row whose environment name is set (``None`` elsewhere);
        each ``start`` runs concurrently. Returns the episodes; their ``prompt`` is the rendered
        initial messages' token ids, or ``None`` to keep the row's prompt."""
        self.environments.check_names(names, "data.env_key")
        episodes: list[Optional[Episode]] = []
        for name, row in zip(names, rows):
            if name in (None, ""):
                episodes.append(None)
                continue
            episodes.append(Episode(str(name), self.environments.make(str(name)), dict(row),
                                    self.environments.limits(str(name)), self))
        loop = self._ensure_loop()

        async def start_all():
            return await asyncio.gather(*[self._start(ep) for ep in episodes if ep is not None])

        asyncio.run_coroutine_threadsafe(start_all(), loop).result()
        return episodes

    async def _start(self, ep: Episode) -> None:
        start = getattr(ep.env, "start", None)
        ep.prompt = None
        if start is None:
            return
        try:
            messages = await asyncio.wait_for(self._call(start, ep.row), timeout=ep.limits.timeout_s)
        except TimeoutError:
            raise EnvError(f"environment '{ep.name}' took over {ep.limits.timeout_s:g} s (env.timeout_s) to start "
                           "an episode") from None
        except Exception as error:
            raise EnvError(f"environment '{ep.name}' failed to start an episode: {type(error).__name__}: "
                           f"{error}") from error
        if messages:
            problem = message_problem(messages, list_only=True)
            if problem:
                raise EnvError(f"environment '{ep.name}' returned malformed initial messages from start(): "
                               f"{problem}")
            ids = self.tok.apply_chat_template(list(messages), tokenize=True, add_generation_prompt=True)
            ep.prompt = list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def submit(self, ep: Episode, token_ids: list[int], used: int, budget: int,
               truncated: bool) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(self._turn(ep, token_ids, used, budget, truncated), self._ensure_loop())

    async def _turn(self, ep: Episode, token_ids: list[int], used: int, budget: int,
                    truncated: bool) -> Optional[list[int]]:
        ep.turns += 1
        ep.model_tokens += len(token_ids)
        max_tokens = ep.token_limit(budget)
        # the turn ended on the episode's token limit (the backend cut it, or it filled the budget)
        cut = bool(truncated) or used >= max_tokens
        text = self.tok.decode(token_ids, skip_special_tokens=True)
        turn = Turn(text=text, token_ids=tuple(token_ids), index=ep.turns - 1, truncated=cut)
        begin = time.perf_counter()
        try:
            step = await asyncio.wait_for(self._call(ep.env.step, turn), timeout=ep.limits.timeout_s)
        except asyncio.TimeoutError:
            ep.timed_out = ep.done = True
            ep.env_seconds += time.perf_counter() - begin
            log.warning("environment '%s' took over %.1f s (env.timeout_s) to answer a turn; episode ended",
                        ep.name, ep.limits.timeout_s)
            await self._close(ep)
            return None
        except Exception as error:
            await self._close(ep, quiet=True)
            raise EnvError(f"environment '{ep.name}' failed on turn {turn.index}: {type(error).__name__}: "
                           f"{error}") from error
        ep.env_seconds += time.perf_counter() - begin
        problem = (f"{type(step).__name__} instead of rlcore.envs.Step" if not isinstance(step, Step)
                   else step_problem(step))
        if problem:
            await self._close(ep, quiet=True)
            raise EnvError(f"environment '{ep.name}' returned a malformed answer from step() on turn {turn.index}: "
                           f"{problem}")
        for key, value in step.metrics.items():
            ep.metrics[key] = ep.metrics.get(key, 0.0) + float(value)
        if step.reward is not None:
            ep.reward = (ep.reward or 0.0) + float(step.reward)
        ids: Optional[list[int]] = None
        if cut or (not step.done and ep.turns >= ep.limits.max_turns):
            ep.truncated = True  # ended on a limit: the token budget or max_turns
        elif not step.done:
            role = getattr(ep.env, "observation_role", "user")
            eos_end = bool(token_ids) and token_ids[-1] in self.renderer.eos_ids
            observation, cut = cap_observation(step.observation, ep.limits.max_observation_chars)
            if cut:
                ep.metrics["observations_cut"] = ep.metrics.get("observations_cut", 0.0) + 1.0
            ids = self.renderer.ids(observation, role, eos_end)
            if used + len(ids) + 1 > max_tokens:  # no room for the observation and one more model token
                ep.truncated, ids = True, None
        if ids is None:
            ep.done = True
            await self._close(ep)
            return None
        ep.observation_tokens += len(ids)
        return ids

    async def _close(self, ep: Episode, quiet: bool = False) -> None:
        """End the episode's environment: its ``close()`` (plain or ``async``), if it has one, runs
        once when the episode ends (done, a limit, or ``env.timeout_s``), so that what it still
        runs (a tool's subprocess) stops. ``quiet``: a failure is logged, not raised (the episode
        already fails with another error)."""
        if ep.closed:
            return
        ep.closed = True
        close = getattr(ep.env, "close", None)
        if not callable(close):
            return
        try:
            await asyncio.wait_for(self._call(close), timeout=ep.limits.timeout_s)
        except TimeoutError:
            log.warning("environment '%s' took over %.1f s (env.timeout_s) to close an episode; left behind",
                        ep.name, ep.limits.timeout_s)
        except Exception as error:
            if quiet:
                log.warning("environment '%s' failed to close: %s: %s", ep.name, type(error).__name__, error)
                return
            raise EnvError(f"environment '{ep.name}' failed to close an episode: {type(error).__name__}: "
                           f"{error}") from error


def episode_metrics(episodes: Sequence[Optional[Episode]]) -> dict[str, float]:
    """Means over a batch's episodes (``env/…``): turns, tool calls, errors, timeouts, environment
    time, tokens by role; and each environment's own counters."""
    eps = [e for e in episodes if e is not None]
    if not eps:
        return {}
    n = float(len(eps))
    out = {"env/episodes": n, "env/turns_mean": sum(e.turns for e in eps) / n,
           "env/turns_max": float(max(e.turns for e in eps)),
           "env/seconds_mean": sum(e.env_seconds for e in eps) / n,
           "env/timeouts": float(sum(e.timed_out for e in eps)),
           "env/truncated_frac": sum(e.truncated for e in eps) / n,
           "env/model_tokens_mean": sum(e.model_tokens for e in eps) / n,
           "env/observation_tokens_mean": sum(e.observation_tokens for e in eps) / n,
           "env/reward_mean": sum(e.reward or 0.0 for e in eps) / n}
    keys = sorted({k for e in eps for k in e.metrics})
    for key in keys:
        out[f"env/{key}"] = sum(e.metrics.get(key, 0.0) for e in eps)
    for key in ("tool_calls", "tool_errors", "tool_timeouts"):
        out.setdefault(f"env/{key}", 0.0)
    return out


class EpisodePrompt(list):
    """A prompt's token ids that also carry its :class:`Episode`: rollout backends play such
    prompts as multi-turn episodes (slicing and batching a list of prompts keeps them)."""

    episode: Optional[Episode] = None

    def __init__(self, ids: Sequence[int], episode: Optional[Episode]):
        super().__init__(ids)
        self.episode = episode

    def __reduce__(self):  # pickles as the plain ids: episodes live in this process only
        return (list, (list(self),))
