"""Reward functions: loading one from a file or module, telling per-sample from batched, calling it safely.

**Per-sample or batched.** The rule, in order:

1. a ``per_sample`` attribute on the function (``True`` / ``False``) decides;
2. otherwise a parameter named ``prompts``, ``responses`` or ``solution_strs`` means *batched*;
3. otherwise a parameter named ``prompt``, ``response`` or ``solution_str`` means *per sample*;
4. otherwise (e.g. only ``**kwargs``) the function is *batched*, the form of ``rlcore_register_rewards``.

**Arguments** are passed by keyword. Per sample: ``prompt``, ``response``, ``prompt_ids``, ``response_ids``
and every dataset column (``ground_truth``, ``data_source`` …) for that sample; batched: ``prompts``,
``responses``, ``prompt_ids``, ``response_ids`` and every column, each a list with one entry per sample.
``solution_str`` / ``solution_strs`` are aliases of the response(s) for functions written that way.
``custom_reward_function.kwargs`` are added. A function without ``**kwargs`` receives only the
arguments it names; a required argument that is not available is an error naming the columns there are.

**Return value.** A number (per sample) or a sequence / tensor / array of numbers (batched). A
``dict`` with a ``"score"`` key may stand for a number; its other numeric keys are logged as
``reward/<name>/<key>`` (mean over samples).

This module imports no third-party package: worker processes load it quickly.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import logging
import os
import pickle
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from rlcore.errors import RewardError
from rlcore.rewards.base import ComponentResult, check_finite, describe_sample

log = logging.getLogger(__name__)

BATCHED_NAMES = frozenset({"prompts", "responses", "solution_strs"})
#: A sample whose call failed and was given the fallback score (``None`` is a result, and an error).
FAILED = object()
PER_SAMPLE_NAMES = frozenset({"prompt", "response", "solution_str"})
_ALIASES = frozenset({"solution_str", "solution_strs"})
_FALLBACK_HINT = "set reward.fallback_score to give failing samples a fixed score instead of stopping"


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _is_file_spec(path: str) -> bool:
    return path.endswith(".py") or os.sep in path or "/" in path or os.path.exists(path)


def _import_file(path: str) -> Any:
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(full):
        raise RewardError(f"custom_reward_function.path: file '{path}' does not exist")
    mod_name = "rlcore_reward_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, full)
    if spec is None or spec.loader is None:
        raise RewardError(f"custom_reward_function.path: '{path}' cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # lets dataclasses and pickling in the file find their module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[mod_name]
        raise RewardError(f"custom_reward_function.path: importing '{path}' failed: {type(e).__name__}: {e}") from e
    return module


def load_function(path: str, name: str) -> Callable[..., Any]:
    """The callable ``name`` from ``path``: a ``.py`` file, or a module (``pkg.mod`` or ``pkg://pkg.mod``)."""
    spec = path[len("pkg://"):] if path.startswith("pkg://") else path
    if not path.startswith("pkg://") and _is_file_spec(path):
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(spec)
        except ImportError as e:
            raise RewardError(f"custom_reward_function.path: '{path}' is neither a file nor an importable "
                              f"module ({type(e).__name__}: {e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise RewardError(f"custom_reward_function.name: '{path}' defines no function '{name}'"
                          + (f" (functions there: {', '.join(found)})" if found else ""))
    return fn


def resolve_ref(ref: Any, cache: dict) -> Callable[..., Any]:
    """A function from a picklable reference: the function itself, or ``("load", path, name)``."""
    if isinstance(ref, tuple) and ref and ref[0] == "load":
        if ref not in cache:
            cache[ref] = load_function(ref[1], ref[2])
        return cache[ref]
    return ref


# ---------------------------------------------------------------------------------------------
# Calling convention
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CallStyle:
    """How a reward function is called."""

    per_sample: bool
    #: Keyword arguments the function names (None: it cannot be inspected).
    params: Optional[frozenset[str]]
    #: Whether it takes ``**kwargs``.
    var_kw: bool
    #: Arguments without a default.
    required: frozenset[str]


def call_style(fn: Callable[..., Any], name: str) -> CallStyle:
    """Inspect ``fn`` once (see the module docstring for the per-sample/batched rule)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    params, required, var_kw = None, frozenset(), True
    if sig is not None:
        kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        ps = list(sig.parameters.values())
        pos_only = [p.name for p in ps if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty]
        if pos_only:
            raise RewardError(f"reward '{name}': positional-only parameters {pos_only} cannot be passed; "
                              "reward functions receive keyword arguments")
        params = frozenset(p.name for p in ps if p.kind in kinds)
        required = frozenset(p.name for p in ps if p.kind in kinds and p.default is p.empty)
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps)
    flag = getattr(fn, "per_sample", None)
    if isinstance(flag, bool):
        per_sample = flag
    elif params is not None and params & BATCHED_NAMES:
        per_sample = False
    elif params is not None and params & PER_SAMPLE_NAMES:
        per_sample = True
    else:
        per_sample = False
    return CallStyle(per_sample, params, var_kw, required)


def sample_arguments(batch: Any, i: int) -> dict[str, Any]:
    """Keyword arguments describing sample ``i`` alone."""
    args = {k: v[i] for k, v in batch.extras.items()}
    args.update(prompt=batch.prompts[i], response=batch.responses[i], solution_str=batch.responses[i],
                prompt_ids=list(batch.prompt_ids[i]), response_ids=list(batch.response_ids[i]))
    return args


def batch_arguments(batch: Any, idx: Sequence[int]) -> dict[str, Any]:
    """Keyword arguments describing the samples ``idx``, each a list."""
    args = {k: [v[i] for i in idx] for k, v in batch.extras.items()}
    responses = [batch.responses[i] for i in idx]
    args.update(prompts=[batch.prompts[i] for i in idx], responses=responses, solution_strs=responses,
                prompt_ids=[list(batch.prompt_ids[i]) for i in idx],
                response_ids=[list(batch.response_ids[i]) for i in idx])
    return args


SAMPLE_FIELDS = ("prompt", "response", "solution_str", "prompt_ids", "response_ids")
BATCH_FIELDS = ("prompts", "responses", "solution_strs", "prompt_ids", "response_ids")


def check_arguments(fn: Callable[..., Any], name: str, columns: Sequence[str], fixed: Sequence[str] = ()) -> None:
    """Before any data is read: every argument ``fn`` requires is a prompt/response field, a dataset
    column in ``columns`` or a fixed keyword in ``fixed`` (``custom_reward_function.kwargs``).

    :raises RewardError: naming the missing arguments and what is available.
    """
    style = call_style(fn, name)
    fields = SAMPLE_FIELDS if style.per_sample else BATCH_FIELDS
    missing = sorted(style.required - set(fields) - set(columns) - set(fixed))
    if missing:
        raise RewardError(f"custom_reward_function.name: reward '{name}' needs argument(s) {', '.join(missing)}, "
                          f"which are neither {'/'.join(fields[:2])} fields nor columns of data.train_files "
                          f"(columns: {', '.join(sorted(columns))}) nor custom_reward_function.kwargs")


def select_arguments(style: CallStyle, args: dict[str, Any], fixed: dict[str, Any], name: str) -> dict[str, Any]:
    """The subset of ``args`` (plus ``fixed``) that the function accepts; error on a missing required one."""
    args = {**args, **fixed}
    if style.params is None:
        chosen = {k: v for k, v in args.items() if k not in _ALIASES}
    elif style.var_kw:
        chosen = {k: v for k, v in args.items() if k not in _ALIASES or k in style.params}
    else:
        chosen = {k: v for k, v in args.items() if k in style.params}
    missing = sorted(style.required - chosen.keys())
    if missing:
        raise RewardError(f"reward '{name}' needs argument(s) {', '.join(missing)}, which are neither "
                          f"prompt/response fields nor dataset columns (available: {', '.join(sorted(args))})")
    return chosen


def to_score(value: Any, who: str) -> tuple[float, dict[str, float]]:
    """A number (or ``{"score": number, ...}``) as ``(float, other numeric entries)``."""
    extra: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(f"{who} returned a dict without a 'score' key (keys: {', '.join(map(str, value))})")
        extra = {str(k): float(v) for k, v in value.items()
                 if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        value = value["score"]
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except (ValueError, RuntimeError) as e:
            raise RewardError(f"{who} returned {type(value).__name__} with several values, not one score") from e
    if isinstance(value, str):
        raise RewardError(f"{who} returned the string {value!r}, not a number")
    try:
        return float(value), extra
    except (TypeError, ValueError) as e:
        raise RewardError(f"{who} returned {value!r} ({type(value).__name__}), not a number") from e


def to_score_list(value: Any, n: int, who: str) -> list[Any]:
    """The per-sample values of a batched function's result; error if it is not ``n`` of them."""
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
        value = value.tolist()
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__len__"):
        raise RewardError(f"{who} returned {type(value).__name__}; a batched reward returns one score per "
                          "sample (a list). If it scores one sample at a time, set its attribute per_sample = True")
    if len(value) != n:
        raise RewardError(f"{who} returned {len(value)} scores for {n} samples")
    return list(value)


# ---------------------------------------------------------------------------------------------
# A named function as a reward component
# ---------------------------------------------------------------------------------------------


class CallTimeout(Exception):
    """A call did not return within its time limit (its thread is left behind)."""


class CallThread:
    """Runs calls in one daemon thread and waits at most ``timeout_s`` for each: the in-process
    (``reward.num_workers=0``) form of the worker pool's timeout.

    A call that does not return in time leaves its thread blocked (a thread cannot be killed); the
    next call gets a new one. The wait is interruptible: a second Ctrl-C stops the run at once.
    """

    def __init__(self) -> None:
        self._jobs: Optional[queue.SimpleQueue] = None
        #: Threads left behind by calls that timed out.
        self.abandoned = 0

    @staticmethod
    def _loop(jobs: queue.SimpleQueue) -> None:
        while True:
            fn, kwargs, box, done = jobs.get()
            try:
                box.append((True, fn(**kwargs)))
            except BaseException as e:  # noqa: BLE001 - handed to the caller, who re-raises it
                box.append((False, e))
            done.set()

    def call(self, fn: Callable[..., Any], kwargs: dict[str, Any], timeout_s: float) -> Any:
        """``fn(**kwargs)``, its exception re-raised here; :class:`CallTimeout` after ``timeout_s``."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(self._jobs,), name="rlcore-reward-call", daemon=True).start()
        box: list[tuple[bool, Any]] = []
        done = threading.Event()
        self._jobs.put((fn, kwargs, box, done))
        if not done.wait(timeout_s):
            self._jobs, self.abandoned = None, self.abandoned + 1
            raise CallTimeout(f"no result within reward.timeout_s={timeout_s:g} s")
        ok, value = box[0]
        if not ok:
            raise value
        return value


class FunctionReward:
    """A named reward function, called per sample or batched, in this process or in a worker pool.

    :param fallback: score given to a sample whose call raises (or times out); None = raise
        :class:`RewardError` showing the sample.
    :param pool: a :class:`~rlcore.rewards.pool.WorkerPool`; every sample is then one task with a timeout.
    :param ref: picklable reference the workers resolve (the function itself, or ``("load", path, name)``).
    :param timeout_s: without a pool, the seconds a sample may take (a batched call: that times the
        number of samples); the function then runs in a worker thread of this process.
    """

    def __init__(self, name: str, fn: Callable[..., Any], *, kwargs: Optional[dict] = None,
                 fallback: Optional[float] = None, pool: Any = None, ref: Any = None,
                 timeout_s: Optional[float] = None):
        self.name, self.fn = name, fn
        self.kwargs = dict(kwargs or {})
        self.fallback = None if fallback is None else float(fallback)
        #: In process: seconds allowed per sample (None: no limit); a pool has its own.
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self._thread = CallThread()
        self.style = call_style(fn, name)
        self.pool = pool
        self.ref = fn if ref is None else ref
        if pool is not None:
            try:
                pickle.dumps(self.ref)
            except Exception as e:
                raise RewardError(f"reward '{name}' cannot run in worker processes (reward.num_workers > 0): it "
                                  f"cannot be pickled ({type(e).__name__}: {e}); define it at module level") from e

    @property
    def who(self) -> str:
        return f"reward '{self.name}'"

    def __call__(self, batch: Any, indices: Optional[Sequence[int]] = None) -> ComponentResult:
        """Scores of the samples ``indices`` of ``batch`` (all when None), in that order."""
        idx = list(range(len(batch.responses))) if indices is None else list(indices)
        if not idx:
            return ComponentResult(scores=[])
        self._timeouts = 0
        if self.pool is not None:
            values, errors, timeouts = self._in_pool(batch, idx)
        elif self.style.per_sample:
            values, errors = self._per_sample(batch, idx), 0
        else:
            values, errors = self._batched(batch, idx), 0
        if self.pool is None:
            timeouts = self._timeouts
        scores: list[float] = []
        extra_sums: dict[str, float] = {}
        for k, v in enumerate(values):
            if v is FAILED:  # failed and given the fallback
                scores.append(self.fallback)  # type: ignore[arg-type]
                errors += 1
                continue
            if v is None:
                raise RewardError(f"{self.who} returned None for sample {idx[k]} instead of a score (a missing "
                                  f"return statement?)\n{describe_sample(batch, idx[k])}")
            s, extra = to_score(v, f"{self.who} on sample {idx[k]}")
            scores.append(s)
            for key, x in extra.items():
                extra_sums[key] = extra_sums.get(key, 0.0) + x
        check_finite(scores, batch, self.name, idx)
        metrics = {f"reward/{self.name}/{k}": v / len(idx) for k, v in extra_sums.items()}
        return ComponentResult(scores=scores, errors=errors, timeouts=timeouts, metrics=metrics)

    # -- ways of calling ----------------------------------------------------------------------
    def _failed(self, batch: Any, i: int, err: str, cause: Optional[BaseException] = None) -> Any:
        """A sample failed: :data:`FAILED` when a fallback score is set, else raise."""
        if self.fallback is not None:
            return FAILED
        raise RewardError(f"{self.who} failed on sample {i}: {err}\n{describe_sample(batch, i)}\n"
                          f"({_FALLBACK_HINT})") from cause

    def _call(self, kwargs: dict[str, Any], samples: int) -> Any:
        """The function called with ``kwargs``, within the time limit of ``samples`` samples."""
        if self.timeout_s is None:
            return self.fn(**kwargs)
        try:
            return self._thread.call(self.fn, kwargs, self.timeout_s * samples)
        except ValueError as e:
            if "main thread" not in str(e):
                raise
        # The function uses signals (e.g. its own alarm-based timeout), which work in the main thread only.
        log.warning(
            "%s needs the main thread (%s): it runs there from now on, without reward.timeout_s; use "
            "reward.num_workers > 0 for a timeout", self.who, "signals work in the main thread only")
        self.timeout_s = None
        return self.fn(**kwargs)

    def _call_one(self, batch: Any, i: int) -> Any:
        if self.style.per_sample:
            return self._call(select_arguments(self.style, sample_arguments(batch, i), self.kwargs, self.name), 1)
        out = self._call(select_arguments(self.style, batch_arguments(batch, [i]), self.kwargs, self.name), 1)
        return to_score_list(out, 1, self.who)[0]

    def _per_sample(self, batch: Any, idx: list[int]) -> list[Any]:
        values = []
        for i in idx:
            try:
                values.append(self._call_one(batch, i))
            except RewardError:
                raise
            except CallTimeout as e:
                self._timeouts += 1
                values.append(self._failed(batch, i, str(e), e))
            except Exception as e:  # noqa: BLE001 - a user's reward may raise anything: reported per sample
                values.append(self._failed(batch, i, f"{type(e).__name__}: {e}", e))
        return values

    def _batched(self, batch: Any, idx: list[int]) -> list[Any]:
        args = select_arguments(self.style, batch_arguments(batch, idx), self.kwargs, self.name)
        try:
            out = self._call(args, len(idx))
        except RewardError:
            raise
        except CallTimeout as e:
            self._timeouts += len(idx)
            return [self._failed(batch, i, f"{e} (a batched call of {len(idx)} samples)", e) for i in idx]
        except Exception as batch_error:
            # Find the sample(s) at fault by calling the function on one sample at a time.
            values = self._per_sample(batch, idx)
            if all(v is not FAILED for v in values):
                raise RewardError(f"{self.who} raised on the batch of {len(idx)} samples but on none of them "
                                  f"alone: {type(batch_error).__name__}: {batch_error}") from batch_error
            return values
        return to_score_list(out, len(idx), self.who)

    def _in_pool(self, batch: Any, idx: list[int]) -> tuple[list[Any], int, int]:
        tasks = []
        for i in idx:
            args = sample_arguments(batch, i) if self.style.per_sample else batch_arguments(batch, [i])
            tasks.append(select_arguments(self.style, args, self.kwargs, self.name))
        values: list[Any] = []
        timeouts = 0
        for i, (status, value, trace) in zip(idx, self.pool.run(self.ref, tasks)):
            if status == "ok":
                values.append(value if self.style.per_sample else to_score_list(value, 1, self.who)[0])
            elif status == "timeout":
                values.append(self._failed(batch, i, f"no result within reward.timeout_s={self.pool.timeout_s:g} s"))
                timeouts += 1
            else:
                values.append(self._failed(batch, i, value + (f"\n  worker traceback:\n{trace}" if trace else "")))
        return values, 0, timeouts
