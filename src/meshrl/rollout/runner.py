"""Many episodes at once on one asyncio event loop: environments step concurrently, generation is batched.

Each episode is a coroutine (reset, then generate → step → bridge, turn by turn). Episodes are split into
`EnvConfig.batches` cohorts; a cohort's generation requests are sent together, as one generator call, once every
live episode of the cohort is waiting for the model. With one cohort every turn is one batch (most tokens per
call); with more, one cohort generates while another's environments think, so slow environments (a sandbox, a
search API) do not leave the generators idle. Which episodes share a call, and each call's sampling seed (from the
round's seed, the cohort and the turn), never depend on timing: a run is reproducible — and resumable bitwise —
with any number of cohorts.

An environment that raises, or answers after `EnvConfig.timeout_s`, ends its episode: reward 0, finish reason
`env_error` / `env_timeout`, counted in the metrics; the other episodes go on. Where environments run is the
caller's choice: in environment processes (`envs=EnvWorkers(...)`, meshrl.rollout.env_pool: what a run does, so a
step that holds its interpreter or crashes costs episodes, not the run), or on this process's threads (no `envs`:
the environments `env_factory` makes). No Monarch imports: generation is the `generate` function the caller passes
(the Controller's generators, or anything else).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import random
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from meshrl.rollout.env_pool import EnvWorkers
from meshrl.rollout.environment import Environment, EpisodeOutcome, as_messages
from meshrl.rollout.episode import Episode, EpisodeRenderer, EpisodeTokens
from meshrl.rollout.row import Row
from meshrl.types import Completion, SamplingParams

# (prompts, sampling) -> one completion per prompt (n = 1), in order. May block: it runs in a worker thread.
GenerateFn = Callable[..., list[Completion]]
"""generate(prompts, params) -> one completion per prompt; generate(prompts, params, images) where some episode's
prompt has images (per prompt, its encoded images)."""


@dataclass
class EpisodeLimits:
    max_turns: int
    max_tokens: int  # the whole episode: prompt, every turn and every observation
    turn_max_tokens: int  # one model turn
    timeout_s: float


class _EnvFailure(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


class _DaemonThreads:
    """Runs an environment's blocking calls on daemon threads, at most `max_threads` at once. A call abandoned
    after its timeout (a step that never returns) keeps its thread, but never the process from exiting: a
    ThreadPoolExecutor's threads are joined at exit, so one hung step used to keep a finished run alive."""

    def __init__(self, max_threads: int) -> None:
        self.slots = threading.BoundedSemaphore(max(1, max_threads))

    def submit(self, fn: Callable, *args: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if future.done():  # cancelled by the timeout
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        def target() -> None:
            with self.slots:
                try:
                    value, error = fn(*args), None
                except BaseException as e:  # noqa: BLE001 - handed to the awaiting episode
                    value, error = None, e
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the event loop is gone: nobody waits for this call any more
                pass

        threading.Thread(target=target, daemon=True, name="meshrl-env").start()
        return future


class _InThreads:
    """Environments made by `factory` in this process, their plain methods on daemon threads."""

    def __init__(self, factory: Callable[[], Environment], max_threads: int) -> None:
        self.factory, self.threads = factory, _DaemonThreads(max_threads)

    async def open(self) -> Any:
        return SimpleNamespace(instance=None)

    def call(self, env: Any, method: str, *args: Any) -> Awaitable:
        if method == "__init__":

            def make() -> None:
                env.instance = self.factory()

            return self.threads.submit(make)
        fn = getattr(env.instance, method)
        return fn(*args) if inspect.iscoroutinefunction(fn) else self.threads.submit(fn, *args)

    def timed_out(self, env: Any, method: str) -> None:
        pass  # the thread is left behind (daemon: it never keeps the process from exiting)

    def release(self, env: Any) -> None:
        pass

    def describe(self, env: Any, method: str) -> str:
        fn = self.factory if method == "__init__" else getattr(env.instance, method, method)
        return str(getattr(fn, "__qualname__", fn))


class _InProcesses:
    """Environments in environment processes (meshrl.rollout.env_pool), awaited on this event loop."""

    def __init__(self, pool: EnvWorkers) -> None:
        self.pool = pool

    async def open(self) -> Any:
        return await asyncio.wrap_future(self.pool.open())

    def call(self, env: Any, method: str, *args: Any) -> Awaitable:
        return asyncio.wrap_future(self.pool.call(env, method, *args))

    def timed_out(self, env: Any, method: str) -> None:
        self.pool.timed_out(env, method)

    def release(self, env: Any) -> None:
        self.pool.release(env)

    def describe(self, env: Any, method: str) -> str:
        return self.pool.describe(method)


def _describe_error(e: BaseException) -> str:
    """An environment's exception as 'Type: message' (one raised in an environment process keeps its own type)."""
    return f"{getattr(e, 'type_name', type(e).__name__)}: {e}"


class _Cohort:
    """Batches the generation requests of a set of episodes: sends them once every live episode waits."""

    def __init__(self, index: int, size: int, send: Callable[[int, int, list], Awaitable[None]]) -> None:
        self.index, self.live, self.send = index, size, send
        self.waiting: list[tuple[int, list[int], int, tuple[bytes, ...], asyncio.Future]] = []
        self.turn = 0
        self.sending: set[asyncio.Task] = set()  # the event loop holds tasks weakly: keep them until done

    def request(self, episode: int, ids: list[int], max_tokens: int, images: tuple[bytes, ...] = ()) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append((episode, ids, max_tokens, images, fut))
        self._maybe_send()
        return fut

    def finished(self) -> None:
        self.live -= 1
        self._maybe_send()

    def _maybe_send(self) -> None:
        if self.waiting and len(self.waiting) == self.live:
            batch, self.waiting = sorted(self.waiting, key=lambda w: w[0]), []
            task = asyncio.ensure_future(self.send(self.index, self.turn, batch))
            self.sending.add(task)
            task.add_done_callback(self.sending.discard)
            self.turn += 1


class EpisodeRunner:
    """Runs episodes of one environment class against a generate function. `envs`: the environment processes
    every environment lives in (then `env_factory` is unused); None: `env_factory()` makes them in this process,
    their plain methods on at most `max_threads` threads."""

    def __init__(
        self,
        env_factory: Callable[[], Environment] | None,
        renderer: EpisodeRenderer,
        generate: GenerateFn,
        limits: EpisodeLimits,
        *,
        batches: int = 1,
        max_threads: int = 32,
        group_rewards: Callable[[Sequence[EpisodeOutcome]], Sequence[float] | None] | None = None,
        envs: EnvWorkers | None = None,
    ) -> None:
        if envs is None and env_factory is None:
            raise ValueError("EpisodeRunner needs env_factory or envs")
        self.env_factory, self.renderer, self.generate, self.limits = env_factory, renderer, generate, limits
        self.batches, self.max_threads, self.group_rewards = batches, max_threads, group_rewards
        self.envs = _InProcesses(envs) if envs is not None else _InThreads(env_factory, max_threads)

    def run(self, rows: Sequence[Row], group_size: int, sampling: SamplingParams, seed: int) -> list[Episode]:
        """`group_size` episodes per row, laid out group by group. `sampling` gives temperature / top-p / top-k /
        stop ids (its n and max_tokens are set per call); `seed` makes every sampling seed and episode seed."""
        return asyncio.run(self.run_async(rows, group_size, sampling, seed))

    async def run_async(
        self, rows: Sequence[Row], group_size: int, sampling: SamplingParams, seed: int
    ) -> list[Episode]:
        n = len(rows) * group_size
        gen_executor = ThreadPoolExecutor(max_workers=max(1, self.batches), thread_name_prefix="meshrl-gen")
        sizes = [n * (c + 1) // self.batches - n * c // self.batches for c in range(self.batches)]

        async def send(cohort: int, turn: int, batch: list) -> None:
            # One generator call per distinct turn budget (most turns share one). Its seed depends only on the
            # round, cohort and turn: timing never changes what is sampled.
            by_budget: dict[int, list] = {}
            for item in batch:
                by_budget.setdefault(item[2], []).append(item)
            for k, (budget, items) in enumerate(sorted(by_budget.items())):
                call_seed = random.Random(f"{seed}/{cohort}/{turn}/{k}").getrandbits(32)
                params = dataclasses.replace(sampling, n=1, max_tokens=budget, seed=call_seed)
                prompts = [ids for _, ids, _, _, _ in items]
                images = [im for _, _, _, im, _ in items]
                with_images = (images,) if any(images) else ()
                try:
                    results = await asyncio.get_running_loop().run_in_executor(
                        gen_executor, self.generate, prompts, params, *with_images
                    )
                except BaseException as e:  # noqa: BLE001 - every waiting episode gets the generator's error
                    for *_, fut in items:
                        if not fut.done():
                            fut.set_exception(e)
                    continue
                for (*_, fut), completion in zip(items, results, strict=True):
                    if not fut.done():
                        fut.set_result(completion)

        cohorts = [_Cohort(c, sizes[c], send) for c in range(self.batches)]
        cohort_of = [c for c in range(self.batches) for _ in range(sizes[c])]
        try:
            episodes = await asyncio.gather(
                *(self._episode(i, rows[i // group_size], cohorts[cohort_of[i]], seed) for i in range(n))
            )
        finally:
            gen_executor.shutdown(wait=False)  # a hung environment's (daemon) thread is left behind
        self._add_group_rewards(episodes, group_size)
        return list(episodes)

    def demonstrations(self, rows: Sequence[Row]) -> list[EpisodeTokens | str | None]:
        """Each row's `env.demonstration(row)` played through the environment, its replies filling the turns
        between (for a supervised warm-up), under the rules of an episode: plain methods on worker threads,
        `limits.timeout_s` per call, and an error or a timeout ends that row's demonstration, never the run.
        Per row: the tokens (loss on the demonstrated turns), the failure as 'env_error: ...' / 'env_timeout: ...',
        or None (no demonstration, or longer than `limits.max_tokens`)."""

        async def every_row() -> list[EpisodeTokens | str | None]:
            return list(await asyncio.gather(*(self._demonstration(row) for row in rows)))

        return asyncio.run(every_row())

    async def _demonstration(self, row: Row) -> EpisodeTokens | str | None:
        env = await self.envs.open()
        try:
            await self._call(env, "__init__")
            demo = await self._call(env, "demonstration", row)
            if not demo:
                return None
            opening = await self._call(env, "reset", row, 0)
            opening = None if opening is None else as_messages(opening)
            messages, ids = self.renderer.opening(row, opening)
            tokens = EpisodeTokens(images=self.renderer.opening_images(row, opening))
            tokens.add_context(ids)
            for turn, text in enumerate(demo[: self.limits.max_turns]):
                turn_ids = self.renderer.scripted_turn_ids(text)
                tokens.add_scripted(turn_ids)
                messages.append({"role": "assistant", "content": text})
                result = await self._call(env, "step", text)
                if result.done or turn + 1 == len(demo):
                    break
                observation = as_messages(result.observation)
                bridge, images = self.renderer.bridge(messages, observation, turn_ids)
                tokens.add_context(bridge)
                tokens.images += images
                messages += observation
        except _EnvFailure as e:
            return f"{e.kind}: {e}"
        except Exception as e:  # noqa: BLE001 - a malformed demonstration or observation is the environment's
            return f"env_error: {type(e).__name__}: {e}"
        finally:
            self.envs.release(env)
        return tokens if len(tokens.tokens) <= self.limits.max_tokens else None

    async def _call(self, env: Any, method: str, *args: Any) -> Any:
        """`method` of the episode's environment (async or not; "__init__": construct it) under the timeout."""
        try:
            return await asyncio.wait_for(self.envs.call(env, method, *args), self.limits.timeout_s)
        except TimeoutError as e:
            self.envs.timed_out(env, method)
            what = self.envs.describe(env, method)
            raise _EnvFailure("env_timeout", f"{what} took over {self.limits.timeout_s}s") from e
        except Exception as e:  # noqa: BLE001 - an environment's bug ends its episode, never the run
            raise _EnvFailure("env_error", _describe_error(e)) from e

    async def _episode(self, index: int, row: Row, cohort: _Cohort, seed: int) -> Episode:
        lim = self.limits
        tokens = EpisodeTokens()
        messages: list[dict[str, Any]] = []
        turn_rewards: list[float] = []
        metrics: dict[str, float] = {}
        correct: bool | None = None
        finish, error, env_time, env = "max_turns", None, 0.0, None
        try:
            env = await self.envs.open()  # a process starting is not the environment's time
            t0 = time.perf_counter()
            try:
                await self._call(env, "__init__")
                episode_seed = random.Random(f"{seed}/env/{index}").getrandbits(32)
                opening = await self._call(env, "reset", row, episode_seed)
                opening = None if opening is None else as_messages(opening)
                messages, ids = self.renderer.opening(row, opening)
                tokens.images = self.renderer.opening_images(row, opening)
            except _EnvFailure:
                raise
            except Exception as e:  # noqa: BLE001 - a bad opening (unrenderable messages) is the environment's
                raise _EnvFailure("env_error", f"{type(e).__name__}: {e}") from e
            finally:
                env_time += time.perf_counter() - t0
            tokens.add_context(ids)
            for turn in range(lim.max_turns):
                budget = min(lim.turn_max_tokens, lim.max_tokens - len(tokens.tokens))
                if budget < 1:
                    finish = "max_tokens"
                    break
                completion = await cohort.request(index, list(tokens.tokens), budget, tokens.images)
                tokens.add_completion(completion)
                text = self.renderer.renderer.completion_text(completion.token_ids)
                messages.append({"role": "assistant", "content": text})
                t0 = time.perf_counter()
                try:
                    result = await self._call(env, "step", text)
                    observation = [] if result.done else as_messages(result.observation)
                except _EnvFailure:
                    raise
                except Exception as e:  # noqa: BLE001 - a malformed StepResult is the environment's error
                    raise _EnvFailure("env_error", f"{type(e).__name__}: {e}") from e
                finally:
                    env_time += time.perf_counter() - t0
                turn_rewards.append(float(result.reward))
                for k, v in result.metrics.items():
                    metrics[k] = metrics.get(k, 0.0) + float(v)
                if result.done:
                    finish, correct = "done", result.correct
                    break
                if turn + 1 == lim.max_turns:
                    break
                try:
                    bridge, images = self.renderer.bridge(messages, observation, completion.token_ids)
                except Exception as e:  # noqa: BLE001 - an observation that cannot be rendered (a bad image) is
                    raise _EnvFailure("env_error", f"{type(e).__name__}: {e}") from e  # the environment's error
                if len(tokens.tokens) + len(bridge) >= lim.max_tokens:
                    finish = "max_tokens"  # no room left for a model token after the observation
                    break
                tokens.add_context(bridge)
                tokens.images += images  # the next turn's prompt holds them: the generator gets them all, in order
                messages += observation
        except _EnvFailure as e:
            finish, error, correct = e.kind, str(e), False
            turn_rewards = [0.0] * len(turn_rewards)
            if not tokens.tokens:  # failed before its opening: the row's prompt, no model token (nothing to learn)
                messages, ids = self.renderer.opening(row, None)
                tokens.add_context(ids)
                tokens.images = self.renderer.opening_images(row, None)
        finally:
            cohort.finished()
            if env is not None:
                self.envs.release(env)
        reward = sum(turn_rewards)
        outcome = EpisodeOutcome(
            row=row,
            messages=messages,
            turn_rewards=turn_rewards,
            reward=reward,
            correct=bool(reward >= 1.0 - 1e-9) if correct is None else bool(correct),
            num_turns=len(tokens.turn_starts),
            finish_reason=finish,
            metrics=metrics,
            error=error,
        )
        return Episode(tokens, outcome, env_time)

    def _add_group_rewards(self, episodes: Sequence[Episode], group_size: int) -> None:
        if self.group_rewards is None:
            return
        for g in range(0, len(episodes), group_size):
            group = episodes[g : g + group_size]
            try:
                extra = self.group_rewards([e.outcome for e in group])
            except Exception as e:  # noqa: BLE001 - scored as no bonus, counted
                for ep in group:
                    ep.outcome.metrics["group_reward_errors"] = 1.0
                    ep.outcome.error = ep.outcome.error or f"group_rewards: {type(e).__name__}: {e}"
                continue
            if extra is None:
                continue
            if len(extra) != len(group):
                raise ValueError(f"group_rewards returned {len(extra)} values for a group of {len(group)} episodes")
            for ep, r in zip(group, extra, strict=True):
                if ep.outcome.error is None:
                    ep.outcome.reward += float(r)


@dataclass
class EpisodeStats:
    """Per-step metrics over a batch of episodes."""

    values: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, episodes: Sequence[Episode]) -> EpisodeStats:
        n = max(1, len(episodes))
        out: dict[str, float] = {
            "turns_per_episode": sum(e.outcome.num_turns for e in episodes) / n,
            "model_tokens_per_episode": sum(e.tokens.num_model_tokens for e in episodes) / n,
            "episode_tokens_mean": sum(len(e.tokens.tokens) for e in episodes) / n,
            # Seconds an episode waited on its environment (reset and steps), on average: episodes overlap, so a
            # sum would exceed the wall time.
            "env_time_per_episode_s": sum(e.env_time_s for e in episodes) / n,
            "env_failures": sum(e.outcome.finish_reason in ("env_error", "env_timeout") for e in episodes),
        }
        reasons: dict[str, int] = {}
        for e in episodes:
            reasons[e.outcome.finish_reason] = reasons.get(e.outcome.finish_reason, 0) + 1
        out.update({f"finish/{k}": v / n for k, v in sorted(reasons.items())})
        keys = sorted({k for e in episodes for k in e.outcome.metrics})
        out.update({f"env/{k}": sum(e.outcome.metrics.get(k, 0.0) for e in episodes) / n for k in keys})
        return cls(out)
