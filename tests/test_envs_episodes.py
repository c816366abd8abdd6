"""Token-in / token-out episodes: rendering between turns, loss masks, limits, failures and reproducibility.

Real parts: BPE tokenizers trained in code with the real Qwen3 and Llama 3 chat templates (as TRL ships them), tiny
random Qwen3 / Llama checkpoints written by transformers, and meshrl's transformers generation engine in process.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from meshrl.envs import EnvConfig
from meshrl.rollout.episode import EpisodeRenderer, EpisodeTokens
from meshrl.rollout.render import RenderConfig, Renderer
from meshrl.rollout.runner import EpisodeLimits, EpisodeRunner, EpisodeStats
from meshrl.tasks.base import Row
from meshrl.tokenizer import default_corpus, train_bpe_tokenizer
from meshrl.types import SamplingParams

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
MAX_LEN = 256


def _template(name: str) -> str:
    import trl

    return (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def make_tokenizer(style: str):
    corpus = default_corpus(300) + ["<tool>2+3</tool>", "<result>5</result>", "Higher.", "Lower."] * 5
    if style == "chatml":
        return train_bpe_tokenizer(corpus, 400)
    if style == "qwen3":
        return train_bpe_tokenizer(corpus, 400, chat_template=_template("qwen3"))
    tok = train_bpe_tokenizer(corpus, 400, chat_template=_template("llama3"), extra_special_tokens=LLAMA3_SPECIALS)
    tok.eos_token, tok.bos_token = "<|eot_id|>", "<|begin_of_text|>"
    return tok


STYLES = ["chatml", "qwen3", "llama3"]


@pytest.fixture(scope="module", params=STYLES)
def style(request):
    return request.param


@pytest.fixture(scope="module")
def tokenizer(style):
    return make_tokenizer(style)


def episode_renderer(tokenizer) -> EpisodeRenderer:
    return EpisodeRenderer(Renderer(tokenizer, RenderConfig(), stop_token_ids=[tokenizer.eos_token_id]))


def test_end_of_turn_is_the_templates_own(style, tokenizer):
    want = {"chatml": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>"}[style]
    assert tokenizer.convert_ids_to_tokens(episode_renderer(tokenizer).end_of_turn_id) == want


@pytest.mark.parametrize("observation_role", ["tool", "user"])
def test_each_turn_extends_the_last_and_equals_the_template(tokenizer, observation_role):
    """A conversation grown turn by turn (the model's tokens kept as written, only the new text tokenized) is,
    token for token, the chat template's rendering of the whole conversation, and each turn's prompt extends the
    previous turn's prompt plus its completion exactly."""
    er = episode_renderer(tokenizer)
    row = Row("Use <tool>expression</tool>. What is 2 + 3?")
    messages, ids = er.opening(row, None)
    turns = ["<tool>2+3</tool>", "<tool>5*1</tool>", "5"]
    prompts = [list(ids)]
    for k, text in enumerate(turns):
        completion = er.scripted_turn_ids(text)  # what a model writes: its tokens, then its end-of-turn
        messages.append({"role": "assistant", "content": text})
        ids = ids + completion
        if k + 1 < len(turns):
            obs = [{"role": observation_role, "content": f"<result>{k + 5}</result>"}]
            ids = ids + er.bridge_ids(messages, obs, completion)
            messages += obs
            assert ids[: len(prompts[-1]) + len(completion)] == prompts[-1] + completion
            prompts.append(list(ids))
    whole = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    assert prompts[-1] == er.renderer.encode(whole)
    assert tokenizer.decode(ids).endswith("5" + tokenizer.convert_ids_to_tokens(er.end_of_turn_id))


def test_qwen3_history_rewrite_does_not_reach_the_episode():
    """Qwen3's template drops an earlier turn's reasoning once a new user message follows: re-rendering the
    conversation would change turn 1's tokens under the model. The episode keeps them as sampled."""
    tok = make_tokenizer("qwen3")
    er = episode_renderer(tok)
    messages, ids = er.opening(Row("Guess my number."), None)
    text = "<think>\nhalf of 16\n</think>\n\n8"
    completion = er.scripted_turn_ids(text)
    messages.append({"role": "assistant", "content": text})
    obs = [{"role": "user", "content": "Higher."}]
    grown = ids + completion + er.bridge_ids(messages, obs, completion)
    rerendered = er.renderer.encode(tok.apply_chat_template(messages + obs, add_generation_prompt=True, tokenize=False))
    assert rerendered[: len(ids) + len(completion)] != ids + completion  # the bug class: history rewritten
    assert grown[: len(ids) + len(completion)] == ids + completion
    assert "half of 16" in tok.decode(grown) and tok.decode(grown).endswith(
        "Higher.<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_turn_cut_at_its_budget_gets_the_end_of_turn_from_the_environment(tokenizer):
    """A completion that hit max_tokens has no stop token: the template's end-of-turn comes with the observation
    (loss mask 0), so the next prompt is still well formed."""
    er = episode_renderer(tokenizer)
    messages, ids = er.opening(Row("hi"), None)
    cut = er.renderer.encode("<tool>2+")  # no end-of-turn
    messages.append({"role": "assistant", "content": "<tool>2+"})
    bridge = er.bridge_ids(messages, [{"role": "user", "content": "go on"}], cut)
    assert bridge[0] == er.end_of_turn_id or tokenizer.decode(bridge).startswith(
        tokenizer.convert_ids_to_tokens(er.end_of_turn_id)
    )


def test_episode_datum_masks_the_environment():
    t = EpisodeTokens()
    t.add_context([5, 6, 7])
    t.turn_starts.append(3)
    t.tokens += [8, 9]
    t.model_mask += [1, 1]
    t.logprobs += [-0.5, -0.25]
    t.add_context([10, 11])
    t.add_scripted([12])
    d = t.datum()
    # Targets are tokens[1:]: 6 7 8 9 10 11 12 -> loss on 8, 9 (sampled) and 12 (scripted).
    assert list(d.loss_mask) == [0, 0, 1, 1, 0, 0, 1]
    assert list(d.old_logprobs) == [0, 0, -0.5, -0.25, 0, 0, 0]
    assert t.num_model_tokens == 3


# ---- real episodes through a generation engine ------------------------------------------------------------------


@pytest.fixture(scope="module", params=[("qwen3", "qwen3"), ("llama", "llama3")], ids=["qwen3", "llama"])
def engine(request, tmp_path_factory):
    """(TransformersEngine over a tiny random checkpoint with that chat template, its EpisodeRenderer)."""
    from meshrl.generation.transformers_engine import TransformersEngine
    from meshrl.models.tiny_hf import create_tiny_checkpoint

    arch, style = request.param
    tok = make_tokenizer(style)
    path = create_tiny_checkpoint(
        tmp_path_factory.mktemp(arch) / "model", arch=arch, tokenizer=tok, seed=3, max_position_embeddings=MAX_LEN
    )
    engine = TransformersEngine(str(path), max_model_len=MAX_LEN, max_num_seqs=16)
    yield engine, EpisodeRenderer(Renderer.from_model_dir(path))
    engine.shutdown()


class Recorder:
    """The engine as the runner's generate function, remembering every completion it returned."""

    def __init__(self, engine) -> None:
        import threading

        self.engine, self.completions, self.calls = engine, [], []
        self.lock = threading.Lock()  # cohorts call from worker threads; the in-process engine takes one at a time

    def __call__(self, prompts, params):
        with self.lock:
            out = [group[0] for group in self.engine.generate(prompts, params, 0)]
        self.completions += out
        self.calls.append(len(prompts))
        return out


def runner(engine, env: str, *, max_turns=3, max_tokens=MAX_LEN, turn_max_tokens=6, timeout_s=5.0, batches=1, **kw):
    eng, er = engine
    cls, make = EnvConfig(name=env, **kw).factory()
    limits = EpisodeLimits(max_turns, max_tokens, turn_max_tokens, timeout_s)
    rec = Recorder(eng)
    return EpisodeRunner(make, er, rec, limits, batches=batches, group_rewards=cls.group_rewards), rec


def sampling(er: EpisodeRenderer, temperature: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=temperature, stop_token_ids=er.renderer.stop_token_ids)


def test_real_episodes_continue_from_their_own_tokens(engine):
    """Every generator call continued exactly the episode's ids so far; the model's tokens carry their sampling
    logprobs and loss mask 1, everything the environment and template added mask 0."""
    from meshrl.envs.guess_number import GuessNumberEnv

    er = engine[1]
    rows = GuessNumberEnv.rows("train", 4, seed=0)
    run, rec = runner(engine, "guess_number", max_turns=3)
    episodes = run.run(rows, 2, sampling(er), seed=7)
    assert len(episodes) == 8 and rec.calls[0] == 8  # the first turn of every episode in one call
    by_prompt: dict[tuple, list] = {}  # the episodes of a group share their first prompt
    for c in rec.completions:
        by_prompt.setdefault(tuple(c.prompt_ids), []).append(c)
    multi = 0
    for e in episodes:
        t = e.tokens
        assert e.outcome.num_turns == len(t.turn_starts) >= 1
        multi += e.outcome.num_turns > 1
        ends = t.turn_starts[1:] + [len(t.tokens)]
        for k, start in enumerate(t.turn_starts):
            # Turn k's prompt is everything before it, exactly, and its tokens are one of that prompt's completions.
            (c,) = [
                c
                for c in by_prompt[tuple(t.tokens[:start])]
                if t.tokens[start : start + len(c.token_ids)] == c.token_ids
            ]
            assert t.logprobs[start : start + len(c.token_ids)] == c.logprobs
            assert t.model_mask[start : start + len(c.token_ids)] == [1] * len(c.token_ids)
            env_part = t.model_mask[start + len(c.token_ids) : ends[k]]
            assert env_part == [0] * len(env_part)
            if k + 1 < len(t.turn_starts):
                assert env_part, "an observation sits between two model turns"
                observation = er.tokenizer.decode(t.tokens[start + len(c.token_ids) : ends[k]])
                assert any(s in observation for s in ("Higher.", "Lower.", "Say a number"))
        assert t.model_mask[: t.turn_starts[0]] == [0] * t.turn_starts[0]
        d = t.datum()
        assert list(d.loss_mask) == t.model_mask[1:] and d.num_loss_tokens == t.num_model_tokens
    assert multi, "a random model should need more than one turn somewhere"


def test_turn_and_token_limits_end_episodes(engine):
    from user_envs import EchoEnv

    er = engine[1]
    rows = EchoEnv.rows("train", 3, 0)
    run, _ = runner(engine, "user_envs:EchoEnv", max_turns=3)
    episodes = run.run(rows, 1, sampling(er), seed=1)
    for e in episodes:
        assert e.outcome.finish_reason == "max_turns" and e.outcome.num_turns == 3
        assert e.outcome.turn_rewards == [0.25] * 3 and e.outcome.reward == 0.75
    prompt_len = len(er.renderer.prompt_ids(rows[0]))
    run, _ = runner(engine, "user_envs:EchoEnv", max_turns=10, max_tokens=prompt_len + 20)
    for e in run.run(rows, 1, sampling(er), seed=1):
        assert e.outcome.finish_reason == "max_tokens", e.outcome
        assert len(e.tokens.tokens) <= prompt_len + 20 and 1 <= e.outcome.num_turns < 10


def test_raising_and_hanging_environments_end_only_their_episode(engine):
    er = engine[1]
    kinds = ["ok", "raise", "hang", "ok"]
    rows = [Row(f"row {i}", info={"kind": k}) for i, k in enumerate(kinds)]
    run, _ = runner(engine, "user_envs:FlakyEnv", timeout_s=1.0)
    t0 = time.perf_counter()
    episodes = run.run(rows, 1, sampling(er), seed=2)
    assert time.perf_counter() - t0 < 4.5  # the hung thread (5 s) is left behind, not waited for
    reasons = [e.outcome.finish_reason for e in episodes]
    assert reasons == ["done", "env_error", "env_timeout", "done"]
    assert [e.outcome.reward for e in episodes] == [1.0, 0.0, 0.0, 1.0]
    assert "environment bug" in episodes[1].outcome.error and not episodes[1].outcome.correct
    assert EpisodeStats.of(episodes).values["env_failures"] == 2

    rows = [Row(f"row {i}", info={"kind": k}) for i, k in enumerate(["stall", "ok"])]
    run, _ = runner(engine, "user_envs:AsyncStallEnv", timeout_s=1.0)
    episodes = run.run(rows, 2, sampling(er), seed=2)
    assert [e.outcome.finish_reason for e in episodes] == ["env_timeout"] * 2 + ["done"] * 2
    assert episodes[2].outcome.messages[0]["content"].startswith("opening")  # the environment's own opening


def test_warmup_demonstrations_keep_the_episode_rules(tokenizer):
    """The supervised warm-up plays demonstrations under the rules of an episode (issue 31, item 3): worker threads
    and --env.timeout-s per call, and a raising or hanging environment costs its row's demonstration, not the run."""
    from user_envs import FlakyEnv

    def no_generation(prompts, params):
        raise AssertionError("a demonstration generates nothing")

    # A timeout far above an "ok" call's time (it failed at 0.5 s on a loaded 2-core machine), far below a hang's 5 s.
    limits = EpisodeLimits(max_turns=3, max_tokens=MAX_LEN, turn_max_tokens=8, timeout_s=1.5)
    run = EpisodeRunner(FlakyEnv, episode_renderer(tokenizer), no_generation, limits)
    rows = [Row(f"row {i}", answer="1", info={"kind": k}) for i, k in enumerate(["ok", "raise", "hang", "hang", "ok"])]
    t0 = time.perf_counter()
    played = run.demonstrations(rows)
    assert time.perf_counter() - t0 < 4.5  # two 5 s steps, cut at 1.5 s (waiting them out would take 5 s or more)
    assert isinstance(played[0], EpisodeTokens) and isinstance(played[4], EpisodeTokens)
    assert played[0].num_model_tokens > 0 and len(played[0].turn_starts) == 2  # both demonstrated turns
    assert played[1] == "env_error: RuntimeError: environment bug"
    assert played[2].startswith("env_timeout: ") and played[3].startswith("env_timeout: ")


@pytest.mark.parametrize("batches", [1, 3])
def test_episodes_are_reproducible_whatever_the_timing(engine, batches):
    """Environments answer after random delays; the episodes sampled are the same every time (which episodes
    share a generator call, and its seed, never depend on timing), with one cohort or several."""
    er = engine[1]
    rows = [Row(f"tell me {i}") for i in range(4)]

    def once():
        run, rec = runner(engine, "user_envs:JitterEnv", max_turns=3, batches=batches)
        eps = run.run(rows, 2, sampling(er), seed=11)
        return [(e.tokens.tokens, e.tokens.logprobs, e.outcome.reward) for e in eps], rec.calls

    (a, calls_a), (b, calls_b) = once(), once()
    assert a == b
    assert a == b  # the order of the calls may differ; their contents and seeds do not
    assert sorted(calls_a) == sorted(calls_b) and max(calls_a) == {1: 8, 3: 3}[batches]  # cohorts of 3, 3, 2


def test_greedy_episodes_repeat_and_group_rewards_apply(engine):
    from meshrl.rollout.environment import Environment

    er = engine[1]
    rows = [Row(f"tell me {i}") for i in range(2)]
    run, _ = runner(engine, "user_envs:EchoEnv", max_turns=2)
    calls = []

    def bonus(outcomes):
        calls.append(len(outcomes))
        return [1.0 if i == 0 else 0.0 for i in range(len(outcomes))]

    run.group_rewards = bonus
    episodes = run.run(rows, 3, sampling(er, 0.0), seed=0)
    assert calls == [3, 3]
    assert [e.outcome.reward for e in episodes] == [1.5, 0.5, 0.5] * 2
    assert episodes[0].tokens.tokens == episodes[1].tokens.tokens  # greedy: the same episode
    assert Environment.group_rewards([]) is None


def test_custom_advantage_gets_per_turn_rewards():
    from meshrl.advantages import ADVANTAGES, compute_advantages, register_advantage

    @register_advantage("test_last_turn")
    def last_turn(rewards, group_size, *, turn_rewards=None):
        return [turns[-1] if turns else 0.0 for turns in turn_rewards]

    try:
        got = compute_advantages("test_last_turn", [1.0, 0.5], 2, turn_rewards=[[0.5, 0.5], [0.0, 0.5]])
        assert got == [0.5, 0.5]
        assert compute_advantages("group_mean", [1.0, 0.0], 2, turn_rewards=[[1.0], [0.0]]) == [0.5, -0.5]
    finally:
        del ADVANTAGES["test_last_turn"]
