"""Reward functions and the scorer that runs them: `fn(completion, row) -> float`, weighted and summed.

A reward function takes the completion text and the row's verifier view (`Row.verifier_view()`: the dataset
row's own fields plus "prompt" and "answer") and returns a number; it may be `async def`. Name them in a spec:

    weights = parse_reward_spec("math_verify=1.0, format=0.1")  # or "my_pkg.rewards:brevity=0.5", ...
    rs = Rubric(weights, ScoringConfig(timeout_s=5))
    [s.reward for s in rs.score(["<think>2+2</think> \\boxed{4}"], [{"prompt": "2+2?", "answer": "4"}])]  # [1.1]

Built-ins: exact_match, char_match, exact, regex, math_verify, format, length_penalty. Register your own with
`@register_reward("name")`, or name any importable function as "package.module:function". A function with a
keyword-only `cfg` parameter receives the run's `ScoringConfig`. One bad sample never kills a run: a function that
raises, returns a non-number or runs past `timeout_s` gives 0 for that sample, recorded in `ScoredSample.failures`.

Library code: no Monarch imports. The reward actor builds nothing itself; it receives a pickled `Rubric`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import inspect
import math
import queue
import re
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from meshrl.errors import ConfigError

RewardFn = Callable[[str, dict], float | Awaitable[float]]
REWARD_FNS: dict[str, RewardFn] = {}

SPEC_FORM = "'name=weight,...', e.g. 'math_verify=1.0,format=0.1' or 'my_pkg.my_mod:fn=0.5' (a bare name weighs 1.0)"


def group_reward(fn: Callable) -> Callable:
    """Mark `fn(completions: list[str], row: dict) -> list[float]` (or async) as a group reward: it is called once
    per group of completions sampled for the same row (a GRPO group) and returns one value per completion — for
    verifiers that judge completions against each other (rankings, pairwise preferences, diversity).

    @group_reward
    def shortest_correct_wins(completions: list[str], row: dict) -> list[float]: ...

    Use it by name in a reward spec like any other (`my_pkg.my_mod:shortest_correct_wins=1.0`). One timeout
    (scoring.timeout_s) covers the whole group; a failure scores 0 for every completion of the group."""
    fn.meshrl_group_reward = True
    return fn


def is_group_reward(fn: Callable) -> bool:
    return bool(getattr(getattr(fn, "func", fn), "meshrl_group_reward", False))


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Register `fn(completion, row) -> float` (or async) under `name`, for reward specs:

    @register_reward("brevity")
    def brevity(completion: str, row: dict) -> float:
        return -len(completion) / 1000

    Register in the controller process, before the Rubric is built. The set travels to the reward processes with
    cloudpickle: a function defined in your script (__main__) travels by value; one from an importable module by
    reference, so that module must import there too (reward processes inherit PYTHONPATH), unless you call
    `cloudpickle.register_pickle_by_value(module)`."""

    def deco(fn: RewardFn) -> RewardFn:
        REWARD_FNS[name] = fn
        return fn

    return deco


@dataclass
class ScoringConfig:
    """How completions are scored: the reward processes, their concurrency and timeouts, built-in reward patterns."""

    timeout_s: float = 10.0
    """Per sample and reward function: past this many seconds the sample gets 0 from that function (counted as a
    timeout). A hung synchronous function is abandoned in its thread, not killed."""
    num_procs: int = 1
    """Reward processes; each scores its share of a batch."""
    num_threads: int = 8
    """Samples scored concurrently in each reward process (threads; async functions run on one event loop per
    thread). Helps I/O-bound verifiers (HTTP, sandboxes); CPU-bound ones (math_verify) need more processes."""
    regex: str = r"(?im)answer\s*[:=]\s*(.+?)\s*$"
    """Pattern of the 'regex' reward, searched in the completion (last match wins; flags inline, e.g. '(?i)'). With a
    group: group 1, stripped, must equal the row's answer. Without one: any match scores 1. The default takes the
    rest of the last line 'Answer: ...'."""
    format_pattern: str = r"<think>(?:(?!</?think>).)+</think>\s*(?:(?!</?think>).)+"
    """Pattern of the 'format' reward, matched (DOTALL) against the whole stripped completion. The default: one
    non-empty <think>...</think> block, then a non-empty answer with no further think tags."""
    length_target: int = 1024
    """Characters: the 'length_penalty' reward is -(len - length_target) / length_target past it, at worst -1."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"--scoring.timeout-s={self.timeout_s}: must be a positive number of seconds")
        if self.num_procs < 1:
            raise ConfigError(f"--scoring.num-procs={self.num_procs}: must be >= 1")
        if self.num_threads < 1:
            raise ConfigError(f"--scoring.num-threads={self.num_threads}: must be >= 1")
        if self.length_target < 1:
            raise ConfigError(f"--scoring.length-target={self.length_target}: must be >= 1 character")
        for flag, pattern in (("regex", self.regex), ("format-pattern", self.format_pattern)):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ConfigError(f"--scoring.{flag}={pattern!r} is not a valid regular expression: {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# Specs and names


def parse_reward_spec(spec: str) -> dict[str, float]:
    """'math_verify=1.0, format=0.1' -> {'math_verify': 1.0, 'format': 0.1}; a bare name weighs 1.0.

    Weights may be negative (penalties) or 0 (computed and logged, not rewarded)."""
    if not spec or not spec.strip():
        raise ConfigError(f"empty reward spec; expected {SPEC_FORM}")
    weights: dict[str, float] = {}
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            raise ConfigError(f"reward spec {spec!r} has an empty item (a stray comma?); expected {SPEC_FORM}")
        name, eq, w = (s.strip() for s in item.partition("="))
        if not name:
            raise ConfigError(f"reward spec item {item!r} has no function name before '='; expected {SPEC_FORM}")
        try:
            weight = float(w) if eq else 1.0
        except ValueError:
            weight = math.nan
        if not math.isfinite(weight):
            raise ConfigError(
                f"reward spec item {item!r}: the weight {w!r} is not a finite number; expected {SPEC_FORM}"
            )
        if name in weights:
            raise ConfigError(f"reward spec {spec!r} names {name!r} twice; give each function one weight")
        weights[name] = weight
    return weights


def resolve_reward(name: str) -> RewardFn:
    """The function a spec name means: a registered name, else 'package.module:function' imported here."""
    if name in REWARD_FNS:
        return REWARD_FNS[name]
    how = (
        f"registered reward functions: {sorted(REWARD_FNS)}; or name an importable function as "
        "'package.module:function' (its directory on PYTHONPATH, or the package installed)"
    )
    if ":" not in name:
        hint = ""
        if "." in name:
            mod, _, attr = name.rpartition(".")
            hint = f" (did you mean '{mod}:{attr}'?)"
        raise ConfigError(f"unknown reward function {name!r}{hint}; {how}")
    mod_name, _, attr = name.partition(":")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as e:
        if e.name and (mod_name == e.name or mod_name.startswith(e.name + ".")):
            raise ConfigError(
                f"reward function {name!r}: no module named {e.name!r}. Put the directory that holds it on "
                "PYTHONPATH (reward processes inherit it) or pip install its package"
            ) from None
        raise ConfigError(f"reward function {name!r}: importing {mod_name!r} failed: {e}") from e
    except Exception as e:
        raise ConfigError(f"reward function {name!r}: importing {mod_name!r} failed: {type(e).__name__}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(k for k in dir(obj) if not k.startswith("_") and callable(getattr(obj, k, None)))
            raise ConfigError(f"reward function {name!r}: {mod_name!r} has no {attr!r}; it defines {defined}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"reward function {name!r} is not callable (an object of type {type(obj).__name__})")
    return obj


CONTRACT = (
    "fn(completion: str, row: dict) -> float, sync or async (a @group_reward: fn(completions: list[str], row: dict) "
    "-> list[float]), where `row` is the row's dict: row['answer'], row['prompt'] and the row's other fields"
)


def check_signature(name: str, fn: Callable) -> None:
    """Refuse at launch a reward function that cannot follow the contract: one that does not take two positional
    arguments, or whose second is named `answer` or annotated `str` (the earlier contract, fn(completion,
    answer: str)): given the row dict it would compare text with a dict and score 0 on every sample, silently."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # C callables without a signature: nothing to check
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = [p for p in positional if p.default is p.empty]
    where = f"reward function {name!r} ({getattr(fn, '__qualname__', fn)})"
    if len(required) > 2 or (len(positional) < 2 and not takes_varargs):
        raise ConfigError(f"{where} takes ({', '.join(p.name for p in positional)}); a reward function is {CONTRACT}")
    if len(positional) >= 2:
        second = positional[1]
        hint = second.annotation  # a string under `from __future__ import annotations`, else the type itself
        annotation = "" if hint is second.empty else hint if isinstance(hint, str) else getattr(hint, "__name__", "")
        if second.name == "answer" or annotation == "str":
            raise ConfigError(
                f"{where}: its second parameter is `{second.name}{': ' + annotation if annotation else ''}`, but "
                f"reward functions now receive the whole row, not the answer string: a reward function is {CONTRACT}. "
                "Change it to fn(completion, row) and read row['answer']"
            )


def check_score_inputs(completions: Any, rows: Any, group_size: int = 1) -> None:
    """`score()`'s arguments as the contract has them: completion texts, one row dict per group. Token ids or
    answer strings in their place would score 0 on every sample; refused instead, saying what was given."""
    if not isinstance(completions, list | tuple) or not all(isinstance(c, str) for c in completions):
        got = type(next((c for c in completions if not isinstance(c, str)), completions)).__name__
        raise TypeError(
            f"score(completions, rows): completions must be a list of str (the completion texts; decode token ids "
            f"first, e.g. with the tokenizer), got {got}"
        )
    if not isinstance(rows, list | tuple) or not all(isinstance(r, Mapping) for r in rows):
        got = type(next((r for r in rows if not isinstance(r, Mapping)), rows)).__name__
        raise TypeError(
            f"score(completions, rows): rows must be a list of row dicts ({{'answer': ..., 'prompt': ..., ...}}: "
            f"Row.verifier_view(); one per completion, or per group of {group_size} in Controller.score), got {got}"
        )


def _bind_cfg(fn: RewardFn, cfg: ScoringConfig) -> RewardFn:
    """Give `cfg` to a function that declares a keyword-only `cfg` parameter (the pattern built-ins)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some builtins and C callables have no signature: they take no cfg
        return fn
    p = params.get("cfg")
    return functools.partial(fn, cfg=cfg) if p is not None and p.kind is p.KEYWORD_ONLY else fn


# ---------------------------------------------------------------------------------------------------------------
# Scoring


@dataclass
class ScoredSample:
    reward: float
    """Weighted sum of the parts."""
    parts: dict[str, float]
    """Each function's raw value (0.0 for a failed one)."""
    failures: dict[str, str] = field(default_factory=dict)
    """Function name -> 'timeout' or 'error: <ExcType>: <msg>' for the functions that failed on this sample."""


_TIMED_OUT = object()  # an async function ran out of time (told apart from a TimeoutError it raised)
_GRACE_S = 0.1  # the watcher waits this much past a deadline, so an async timeout that fires on time wins the race


@dataclass(eq=False)
class _Job:
    sample: int
    name: str
    fn: RewardFn
    completion: str | list[str]  # a group job: the group's completions
    row: dict
    timeout_s: float
    future: Future = field(default_factory=Future)
    started: float | None = None  # time.monotonic() when a worker picked it up: the deadline counts from here
    events: queue.SimpleQueue | None = None  # its score() call's event queue
    group: int = 0  # > 0: a group reward's job over samples sample .. sample + group - 1


def _as_reward(value: Any) -> float:
    if isinstance(value, str | bytes) or not hasattr(type(value), "__float__"):
        raise TypeError(f"returned {type(value).__name__}, not a number")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"returned {out}")
    return out


def _as_group_rewards(values: Any, n: int) -> list[float]:
    if isinstance(values, str | bytes | Mapping) or not hasattr(values, "__len__"):
        raise TypeError(f"a group reward returned {type(values).__name__}, not a list of {n} numbers")
    if len(values) != n:
        raise ValueError(f"a group reward returned {len(values)} values for a group of {n} completions")
    return [_as_reward(v) for v in values]


async def _bounded(aw: Awaitable[Any], timeout_s: float) -> Any:
    """`aw`'s result, or _TIMED_OUT (cancelling it) after `timeout_s`. Unlike wait_for, a TimeoutError that the
    function raises itself stays an error."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if done:
        return task.result()
    task.cancel()
    await asyncio.wait({task}, timeout=_GRACE_S)  # let it unwind, but not forever
    return _TIMED_OUT


def _worker(jobs: queue.SimpleQueue) -> None:
    # Daemon threads with their own loop: a hung verifier must neither block interpreter exit (as
    # ThreadPoolExecutor's joined threads would) nor share an event loop with the samples beside it.
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        while (job := jobs.get()) is not None:
            if not job.future.set_running_or_notify_cancel():
                continue  # moved to a fresh pool
            job.started = time.monotonic()
            job.events.put(job)
            try:
                value = job.fn(job.completion, job.row)
                if inspect.isawaitable(value):
                    left = job.timeout_s - (time.monotonic() - job.started)
                    value = loop.run_until_complete(_bounded(value, max(left, 0.0)))
                if value is not _TIMED_OUT:
                    value = _as_group_rewards(value, job.group) if job.group else _as_reward(value)
                job.future.set_result(value)
            except BaseException as e:  # noqa: B036 - whatever a user function raises is that sample's failure
                job.future.set_exception(e)
            job.events.put(job)
    finally:
        loop.close()


class _Pool:
    """A fixed set of daemon worker threads over one queue."""

    def __init__(self, num_threads: int) -> None:
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [
            threading.Thread(target=_worker, args=(self.jobs,), name=f"reward-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for t in self.threads:
            t.start()

    def submit(self, job: _Job) -> None:
        self.jobs.put(job)

    def shutdown(self) -> None:
        """Each thread exits after its current job (a hung one: whenever its function returns)."""
        for _ in self.threads:
            self.jobs.put(None)


class Rubric:
    """A run's rubric: weighted reward functions (group rewards among them), scored concurrently with per-sample
    timeouts — in the reward processes (`--scoring.num-procs`), so CPU-bound verifiers never slow the controller.
    It scores a task's one-turn episodes, and adds to an environment's rewards when `--reward` is given with `--env`.

    rs = Rubric({"math_verify": 1.0, "mine": 0.5}, ScoringConfig(num_threads=8), fns={"mine": my_fn})
    samples = rs.score(completions, [row.verifier_view() for row in rows])

    Built in the controller process (so functions a user registered or defined there resolve), then pickled whole
    to the reward processes (Monarch uses cloudpickle: functions from an importable module travel by reference,
    functions from __main__ and closures by value). The worker threads are made lazily and never pickled.

    Thread safety: reward functions run concurrently in `num_threads` threads, so they must not share mutable
    state without a lock. An async function runs on its worker thread's own event loop, so an async client must be
    made per call (or per thread), not once for the whole process. `score` calls on one set are serialised."""

    def __init__(
        self,
        weights: Mapping[str, float],
        cfg: ScoringConfig | None = None,
        *,
        fns: Mapping[str, RewardFn] | None = None,
    ) -> None:
        if not weights:
            raise ConfigError(f"no reward functions given; expected {SPEC_FORM}")
        self.cfg = cfg or ScoringConfig()
        fns = dict(fns or {})
        unknown = sorted(set(fns) - set(weights))
        if unknown:
            raise ConfigError(f"fns given for {unknown}, which have no weight; weights name {sorted(weights)}")
        self._weights: dict[str, float] = {}
        self._fns: dict[str, RewardFn] = {}
        for name, w in weights.items():
            if not math.isfinite(w):
                raise ConfigError(f"reward {name!r} has weight {w}; weights must be finite numbers")
            fn = fns[name] if name in fns else resolve_reward(name)
            if not callable(fn):
                raise ConfigError(f"reward {name!r} is not callable (an object of type {type(fn).__name__})")
            check_signature(name, getattr(fn, "func", fn))
            if fn is math_verify:  # a missing package must fail the launch, not give every sample 0
                try:
                    _math_verify_api()
                except ImportError as e:
                    raise ConfigError(f"reward 'math_verify' needs the math-verify package: {e}") from e
            self._weights[name] = float(w)
            self._fns[name] = _bind_cfg(fn, self.cfg)
        self._lock = threading.Lock()
        self._pool: _Pool | None = None

    @property
    def names(self) -> list[str]:
        return list(self._weights)

    @property
    def weights(self) -> dict[str, float]:
        return dict(self._weights)

    def is_group(self, name: str) -> bool:
        """Whether function `name` is a group reward (it scores a group's completions together)."""
        return is_group_reward(self._fns[name])

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_pool")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pool = None

    def score(
        self, completions: list[str], rows: list[dict], group_size: int = 1, *, only: str | None = None
    ) -> list[ScoredSample]:
        """One ScoredSample per completion; `rows[i]` is completion i's row (its verifier view). Consecutive runs
        of `group_size` completions share a row (a GRPO group): group rewards (`group_reward`) see each run whole.
        `only`: run that one function (the others' parts are 0, not failures): how a reward process that dies on
        a request finds the function and sample that kill it (controller/reward_pool.py)."""
        check_score_inputs(completions, rows, group_size)
        if only is not None and only not in self._fns:
            raise ValueError(f"no reward function {only!r}; this rubric has {self.names}")
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
        if group_size < 1 or len(completions) % group_size:
            raise ValueError(f"{len(completions)} completions do not split into groups of {group_size}")
        timeout = self.cfg.timeout_s
        fns = self._fns if only is None else {only: self._fns[only]}
        per_sample = {n: fn for n, fn in fns.items() if not is_group_reward(fn)}
        per_group = {n: fn for n, fn in fns.items() if is_group_reward(fn)}
        jobs = [
            _Job(i, name, fn, c, row, timeout)
            for i, (c, row) in enumerate(zip(completions, rows, strict=True))
            for name, fn in per_sample.items()
        ]
        jobs += [
            _Job(i, name, fn, completions[i : i + group_size], rows[i], timeout, group=group_size)
            for i in range(0, len(completions), group_size)
            for name, fn in per_group.items()
        ]
        parts: list[dict[str, float]] = [dict.fromkeys(self._fns, 0.0) for _ in completions]
        failures: list[dict[str, str]] = [{} for _ in completions]
        events: queue.SimpleQueue = queue.SimpleQueue()  # jobs, put by workers as they start and as they finish

        def record(job: _Job, value: float | list[float] | None, failure: str | None) -> None:
            samples = range(job.sample, job.sample + max(job.group, 1))
            values = value if job.group and value is not None else [value] * len(samples)
            for i, v in zip(samples, values, strict=True):
                if v is not None:
                    parts[i][job.name] = v
                if failure is not None:
                    failures[i][job.name] = failure

        with self._lock:
            if self._pool is None:
                self._pool = _Pool(self.cfg.num_threads)
            for job in jobs:
                job.events = events
                self._pool.submit(job)
            self._wait(dict.fromkeys(jobs), events, record)
        return [
            ScoredSample(sum(self._weights[n] * v for n, v in p.items()), p, f)
            for p, f in zip(parts, failures, strict=True)
        ]

    def _wait(self, pending: dict[_Job, None], events: queue.SimpleQueue, record: Callable) -> None:
        """Record each job's outcome as workers report it, and time out the running ones.

        Every job has the same timeout, so deadlines fall in start order: `running` (insertion-ordered, filled as
        start events arrive) has the earliest deadline first, and each wake-up costs O(events), not O(batch)."""
        timeout = self.cfg.timeout_s + _GRACE_S
        running: dict[_Job, None] = {}

        def handle(job: _Job) -> None:
            if job not in pending:
                return  # a late event of a job already recorded
            if not job.future.done():
                running[job] = None  # its start
                return
            del pending[job]
            running.pop(job, None)
            exc = job.future.exception()
            if exc is not None:
                record(job, None, f"error: {type(exc).__name__}: {exc}"[:300])
            elif job.future.result() is _TIMED_OUT:
                record(job, None, "timeout")
            else:
                record(job, job.future.result(), None)

        while pending:
            first = next(iter(running), None)
            wake = first.started + timeout - time.monotonic() if first is not None else timeout
            try:
                handle(events.get(timeout=max(wake, 0.0)))
                while True:
                    handle(events.get_nowait())
            except queue.Empty:
                pass
            now = time.monotonic()
            abandoned = False
            while running and (first := next(iter(running))).started + timeout <= now:
                del running[first]
                if first.future.done():  # finished as its deadline passed: its event is in the queue
                    handle(first)
                else:
                    del pending[first]
                    record(first, None, "timeout")
                    abandoned = True
            if abandoned:
                self._replace_pool(pending)

    def _replace_pool(self, pending: dict[_Job, None]) -> None:
        """Threads stuck in abandoned jobs are lost to the pool: start a full fresh one and move the jobs that have
        not started onto it (those already running finish where they are)."""
        old, self._pool = self._pool, _Pool(self.cfg.num_threads)
        for job in list(pending):
            if job.future.cancel():  # the old queue keeps the cancelled job, which its workers skip: submit a copy
                del pending[job]
                moved = dataclasses.replace(job, future=Future())
                pending[moved] = None
                self._pool.submit(moved)
        old.shutdown()

    def close(self) -> None:
        """Stop the worker threads (a later `score` starts new ones)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown()
                self._pool = None


# ---------------------------------------------------------------------------------------------------------------
# Built-in reward functions


def _answer(row: Mapping[str, Any], who: str) -> str:
    answer = row.get("answer")
    if answer is None:
        raise ValueError(f"{who} needs the row's answer")
    return str(answer)


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def _after_hashes(text: str) -> str | None:
    """The first line after the last '####' (GSM8K's final-answer marker), or None."""
    if "####" not in text:
        return None
    tail = text.rpartition("####")[2].strip()
    return tail.splitlines()[0].strip() if tail else None


def _final_answer(text: str) -> str | None:
    boxed = _last_boxed(text)
    return boxed.strip() if boxed is not None else _after_hashes(text)


@register_reward("exact_match")
def exact_match(completion: str, row: dict) -> float:
    """1.0 if the completion is exactly the answer (no normalisation), else 0.0."""
    return float(completion == _answer(row, "exact_match"))


@register_reward("char_match")
def char_match(completion: str, row: dict) -> float:
    """Fraction of positions right, over the longer of the two strings: dense partial credit that also
    penalises answers that are too long or too short (1.0 when both are empty)."""
    answer = _answer(row, "char_match")
    if not completion and not answer:
        return 1.0
    hits = sum(a == b for a, b in zip(completion, answer, strict=False))
    return hits / max(len(completion), len(answer))


@register_reward("exact")
def exact(completion: str, row: dict) -> float:
    """1.0 if the completion, whitespace stripped, equals the answer, or if its final answer does: the content of
    its last \\boxed{...}, else the line after its last '####' (GSM8K). The answer is read the same way, so a gold
    'reasoning... #### 42' means '42'."""
    answer = _answer(row, "exact").strip()
    gold = _final_answer(answer) or answer
    return float(completion.strip() == gold or _final_answer(completion) == gold)


@register_reward("regex")
def regex(completion: str, row: dict, *, cfg: ScoringConfig | None = None) -> float:
    """`--scoring.regex` searched in the completion, last match wins. With a group: 1.0 if group 1, stripped,
    equals the answer (stripped). Without a group: 1.0 on any match. Default: the line 'Answer: <answer>'."""
    pattern = re.compile((cfg or _default_cfg()).regex)
    match = None
    for match in pattern.finditer(completion):  # noqa: B007 - the last one is wanted
        pass
    if match is None:
        return 0.0
    if pattern.groups == 0:
        return 1.0
    return float((match.group(1) or "").strip() == _answer(row, "regex").strip())


@register_reward("format")
def format_reward(completion: str, row: dict, *, cfg: ScoringConfig | None = None) -> float:
    """1.0 if the stripped completion fully matches `--scoring.format-pattern` (DOTALL), else 0.0. Default: a
    non-empty <think>...</think> block, then a non-empty answer."""
    pattern = re.compile((cfg or _default_cfg()).format_pattern, re.DOTALL)
    return float(pattern.fullmatch(completion.strip()) is not None)


@register_reward("length_penalty")
def length_penalty(completion: str, row: dict, *, cfg: ScoringConfig | None = None) -> float:
    """0 up to `--scoring.length-target` characters, then -(len - target) / target, at worst -1.0 (at twice the
    target). Give it a positive weight: it is already a penalty."""
    target = (cfg or _default_cfg()).length_target
    return -min(1.0, max(0, len(completion) - target) / target)


@functools.cache
def _default_cfg() -> ScoringConfig:
    return ScoringConfig()


# math_verify: sympy comparisons of huge numbers (9^9^9, (10^10)!) run inside C big-integer code that holds the
# GIL: no thread timeout, nor math_verify's own signal alarm, can interrupt them, and the whole reward process
# freezes. Completions with such numbers are refused before comparing (counted as an error, reward 0).
_MAX_EXPONENT = 1e5  # of a numeric power: 10^{100000} compares in ~0.1 s
_MAX_SYMBOLIC_EXPONENT = 200  # of a symbolic power: sympy expands (1+x)^{1000} in seconds, (1+x)^{10000} in minutes
_MAX_BITS = 4e5  # log2 of a number's size (powers, factorials, binomials)


def _log2_abs(x: Any) -> float:
    """log2 |x| of a numeric sympy expression, from a 15-digit float (mpmath exponents are unbounded)."""
    import mpmath
    import sympy

    try:
        v = mpmath.mpf(sympy.Abs(sympy.N(x, 15)))
    except (TypeError, ValueError, AttributeError):  # nan, zoo: not a size to worry about
        return 0.0
    return -math.inf if v == 0 else float(mpmath.log(v, 2))


def _too_large(expr: Any) -> str | None:
    """The first sub-expression (innermost first, so each size estimate is itself safe) too big to compare."""
    import sympy
    from sympy.functions.combinatorial.factorials import CombinatorialFunction

    units = (sympy.S.Zero, sympy.S.One, sympy.S.NegativeOne, sympy.I, -sympy.I)
    for node in sympy.postorder_traversal(expr):
        if isinstance(node, sympy.Pow) and node.exp.is_number and node.base not in units:
            log_exp = _log2_abs(node.exp)
            if not node.base.is_number:
                if log_exp > math.log2(_MAX_SYMBOLIC_EXPONENT):
                    return str(node)
            elif log_exp > math.log2(_MAX_EXPONENT) or 2**log_exp * abs(_log2_abs(node.base)) > _MAX_BITS:
                return str(node)
        elif isinstance(node, CombinatorialFunction) and node.is_number and abs(_log2_abs(node)) > _MAX_BITS:
            return str(node)
    return None


@functools.cache
def _math_verify_api() -> tuple[Any, Any, list[Any]]:
    import math_verify.grader
    import math_verify.parser
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    # Its timeouts are signal.alarm, which only works in the main thread; Rubric times out instead (see below).
    # Silence the warning it logs once when told so.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return parse, verify, [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


# A full stop right after a number: math_verify reads 'The answer is 439/7.' as 439/7.0, a float that then fails to
# equal the rational 439/7 (decimal points, followed by a digit, are kept).
_SENTENCE_END = re.compile(r"(?<=\d)\.(?=\s|$)")


@functools.lru_cache(maxsize=4096)  # a GRPO group scores one gold answer G times; sympy objects are immutable
def _parse_gold(answer: str) -> list[Any]:
    parse, _, extraction = _math_verify_api()
    gold = _SENTENCE_END.sub("", _after_hashes(answer) or answer.strip())
    # Bare LaTeX ('\\frac12', '\\sqrt{2}') is only found between math delimiters.
    if "$" not in gold and "\\boxed" not in gold and "\\(" not in gold and "\\[" not in gold:
        gold = f"${gold}$"
    return parse(gold, extraction, parsing_timeout=None)


def math_parseable(answers: list[str | None], *, stop_at: int | None = None) -> int:
    """How many of `answers` read as math: a number or a LaTeX expression that math-verify parses. (math-verify
    parses 'B' or 'Paris' too, as symbols, but letter answers scored 0 on every completion where this was tried.)"""
    count = 0
    for answer in answers:
        text = "" if answer is None else str(answer)
        if not any(ch.isdigit() for ch in text) and "\\" not in text:
            continue
        try:
            count += bool(_parse_gold(text))
        except Exception:  # noqa: BLE001 - an answer it cannot parse is what is being counted
            pass
        if stop_at is not None and count >= stop_at:  # enough to know (math-verify's parser is slow)
            break
    return count


@register_reward("math_verify")
def math_verify(completion: str, row: dict) -> float:
    """1.0 if the completion's final answer is mathematically equal to the row's answer (math-verify: sympy), else
    0.0. The completion's answer: its last \\boxed{...} first, else the line after a final '####', else LaTeX or a
    plain expression found in the text ('The answer is 42.'). The gold may be a number ('1,234'), LaTeX
    ('\\frac12', '$\\sqrt{2}$', '\\boxed{7}') or a GSM8K solution ending '#### 42'."""
    parse, verify, extraction = _math_verify_api()
    gold = _parse_gold(_answer(row, "math_verify"))
    if not gold:
        raise ValueError(f"math_verify could not parse the answer {row['answer']!r}")
    text = completion
    if "\\boxed" not in completion and (tail := _after_hashes(completion)):
        text = tail  # GSM8K style: trailing prose after '#### 42' must not become the answer
    pred = parse(_SENTENCE_END.sub("", text), extraction, parsing_timeout=None)
    for p in pred:
        if not isinstance(p, str) and (big := _too_large(p)) is not None:
            raise ValueError(f"expression too large to compare: {big[:80]}")
    return float(verify(gold, pred, timeout_seconds=None))


RewardSet = Rubric  # the earlier name, kept for code written against it
