"""Algorithm breadth, library level (no actors): every policy loss × aggregation, KL and TIS against an
independent implementation, advantages, reward shaping, dynamic sampling, and launch-time config errors.

Independent implementations:
* TRL (`pip install trl`, test-only; it installs cleanly here: only `accelerate` comes with it). Its
  `GRPOTrainer._compute_loss` implements the GRPO / BNPO / Dr.GRPO / DAPO / LUSPO aggregations, GSPO
  (importance_sampling_level="sequence"), CISPO, the k3 KL term and vLLM truncated importance sampling; we call
  that method itself on a stub trainer, feeding the same per-token logprobs, and compare value and gradient.
* For what TRL does not implement (k1/k2 KL, REINFORCE, RLOO and REINFORCE++ advantages, DAPO's overlong
  shaping), expected values are derived by hand from the papers' formulas with plain Python loops, written
  without our code.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from meshrl.advantages import compute_advantages
from meshrl.algorithms import informative_groups, kl_penalties, overlong_penalty, step_loss_spec
from meshrl.config import ConfigError, GeneratorConfig, GRPOConfig, GRPORunConfig
from meshrl.losses import AGGREGATIONS, LossBatch, compute_loss, kl_estimate, make_loss_spec
from meshrl.types import Completion, Datum, LossSpec

B, T = 4, 6
LENGTHS = [6, 3, 5, 1]  # right-padded completions of different lengths


def _inputs(seed: int = 0, noise: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS])
    old = -torch.rand(B, T, generator=g) * 2 * mask  # generator logprobs, 0 on padding
    logp = old + torch.randn(B, T, generator=g) * noise
    ref = old + torch.randn(B, T, generator=g) * 0.3
    adv = torch.randn(B, generator=g)
    return logp.detach(), old, ref, mask, adv


def ours(logp, old, ref, mask, adv, **spec):
    x = logp.clone().requires_grad_(True)
    loss, metrics = compute_loss(
        x, LossBatch(mask=mask, old_logprobs=old, advantages=adv, ref_logprobs=ref), LossSpec(**spec)
    )
    loss.backward()
    return loss.item(), x.grad, {k: v.item() for k, v in metrics.items()}


# ---- TRL -----------------------------------------------------------------------------------------------------
def trl(logp, old, ref, mask, adv, *, loss_type, eps_low=0.2, eps_high=0.2, level="token", beta=0.0,
        num_items=None, max_completion_length=T, tis_cap=None, grad_accum=1):  # fmt: skip
    """GRPOTrainer._compute_loss on a stub trainer (one process) whose model returns our logprobs."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    x = logp.clone().requires_grad_(True)
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": torch.tensor(float(num_items if num_items is not None else mask.sum())),
    }
    if beta:
        inputs["ref_per_token_logps"] = ref
    if tis_cap is not None:
        # TRL computes the trainer's "old" logprobs in a separate no-grad forward (here: our logprobs, detached),
        # and the token_truncate ratio as in GRPOTrainer._generate_and_score_completions:
        # clamp(exp((old - sampling) * mask), max=C); the generator's logprobs are the sampling logprobs.
        inputs["old_per_token_logps"] = logp.detach()
        inputs["importance_sampling_ratio"] = torch.clamp(torch.exp((logp.detach() - old) * mask), max=tis_cap)
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (x, torch.zeros_like(x), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=eps_low,
        epsilon_high=eps_high,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        use_vllm=tis_cap is not None,
        vllm_importance_sampling_correction=tis_cap is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum,
        accelerator=SimpleNamespace(
            num_processes=1, gather=lambda t: t, gather_for_metrics=lambda t: t, reduce=lambda t, reduction: t
        ),
        max_completion_length=max_completion_length,
        _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    loss.backward()
    return loss.item(), x.grad, {k: v[-1] for k, v in stub._metrics["train"].items()}


N_TOK = float(sum(LENGTHS))
N_GLOBAL = N_TOK * 3  # this batch is one third of the optimiser step's loss tokens
CLIP = {"clip_low": 0.2, "clip_high": 0.28}
# (id, our LossSpec, TRL arguments, noise of logp around the generator's logprobs)
CASES = [
    ("grpo/seq_mean_token_mean", dict(name="grpo", params=CLIP, aggregation="seq_mean_token_mean", normalizer=B),
     dict(loss_type="grpo", eps_high=0.28), 0.3),
    ("grpo/token_mean(local)", dict(name="grpo", params=CLIP, num_loss_tokens=int(N_TOK)),
     dict(loss_type="bnpo", eps_high=0.28), 0.3),
    ("dapo/token_mean(global)", dict(name="grpo", params=CLIP, normalizer=N_GLOBAL),
     dict(loss_type="dapo", eps_high=0.28, num_items=N_GLOBAL), 0.3),
    ("dr_grpo/token_sum_norm", dict(name="grpo", aggregation="token_sum_norm", normalizer=B * 10),
     dict(loss_type="dr_grpo", max_completion_length=10), 0.3),
    ("grpo/seq_mean_token_sum", dict(name="grpo", aggregation="seq_mean_token_sum", normalizer=B),
     dict(loss_type="luspo"), 0.3),
    ("gspo", dict(name="gspo", aggregation="seq_mean_token_mean", normalizer=B),
     dict(loss_type="grpo", level="sequence", eps_low=3e-4, eps_high=4e-4), 1e-3),
    ("cispo", dict(name="cispo", params={"clip_high": 0.3}, normalizer=N_GLOBAL),
     dict(loss_type="cispo", eps_high=1.3, num_items=N_GLOBAL), 0.3),
    ("importance_sampling", dict(name="importance_sampling", num_loss_tokens=int(N_TOK)),
     dict(loss_type="bnpo", eps_low=1e6, eps_high=1e6), 0.3),  # TRL's clipped loss with clipping out of reach
    ("grpo+kl_k3", dict(name="grpo", num_loss_tokens=int(N_TOK), kl_coef=0.05, kl_estimator="k3"),
     dict(loss_type="bnpo", beta=0.05), 0.3),
    ("grpo+tis", dict(name="grpo", params=CLIP, num_loss_tokens=int(N_TOK), tis_cap=1.5),
     dict(loss_type="bnpo", eps_high=0.28, tis_cap=1.5), 0.3),
    ("cispo+tis+kl", dict(name="cispo", params={"clip_high": 4.0}, normalizer=N_GLOBAL, tis_cap=2.0, kl_coef=0.1),
     dict(loss_type="cispo", eps_high=5.0, num_items=N_GLOBAL, tis_cap=2.0, beta=0.1), 0.3),
]  # fmt: skip


@pytest.mark.parametrize("spec, trl_kw, noise", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_loss_value_and_gradient_match_trl(spec, trl_kw, noise):
    pytest.importorskip("trl")
    for seed in range(3):
        x = _inputs(seed, noise)
        v_ours, g_ours, m_ours = ours(*x, **spec)
        v_trl, g_trl, m_trl = trl(*x, **trl_kw)
        assert v_ours == pytest.approx(v_trl, rel=1e-5, abs=1e-7), seed
        torch.testing.assert_close(g_ours, g_trl, rtol=1e-5, atol=1e-7)
        if "clip_ratio/region_mean" in m_trl and spec["name"] == "grpo":  # (TRL counts GSPO's per sequence)
            assert m_ours["clip_frac"] / N_TOK == pytest.approx(m_trl["clip_ratio/region_mean"], abs=1e-6)
        if "kl" in m_trl:
            assert m_ours["kl"] / N_TOK == pytest.approx(m_trl["kl"], rel=1e-5)


def test_the_comparisons_exercise_clipping_and_truncation():
    """Not vacuous: with these inputs some ratios are clipped and some kept, and TIS truncates some weights."""
    for name, spec, noise in (
        ("grpo", dict(params=CLIP), 0.3),
        ("gspo", dict(aggregation="seq_mean_token_mean", normalizer=B), 1e-3),
    ):
        fracs = [
            ours(*_inputs(s, noise), name=name, num_loss_tokens=int(N_TOK), **spec)[2]["clip_frac"] / N_TOK
            for s in range(3)
        ]
        assert any(0 < f < 1 for f in fracs), (name, fracs)
    m = ours(*_inputs(0), name="grpo", num_loss_tokens=int(N_TOK), tis_cap=1.1)[2]
    assert 0 < m["tis_truncated"] < N_TOK  # fmt: skip


def test_dapo_global_normaliser_over_micro_batches_matches_trl_on_the_whole_batch():
    """Two micro-batches, each divided by the step's token count, add up to TRL's DAPO loss of the whole batch."""
    pytest.importorskip("trl")
    logp, old, ref, mask, adv = _inputs(1)
    v_trl, g_trl, _ = trl(logp, old, ref, mask, adv, loss_type="dapo", eps_high=0.28, num_items=N_TOK)
    total, grads = 0.0, []
    for rows in (slice(0, 1), slice(1, 4)):  # uneven split: 6 tokens, then 9
        v, g, _ = ours(
            logp[rows], old[rows], ref[rows], mask[rows], adv[rows], name="grpo", params=CLIP, normalizer=N_TOK
        )
        total, grads = total + v, grads + [g]
    assert total == pytest.approx(v_trl, rel=1e-5)
    torch.testing.assert_close(torch.cat(grads), g_trl, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"])
@pytest.mark.parametrize("name", ["grpo", "cispo", "reinforce"])
def test_every_aggregation_is_additive_over_micro_batches(aggregation, name):
    logp, old, ref, mask, adv = _inputs(2)
    norm = 7.5
    whole = ours(logp, old, ref, mask, adv, name=name, aggregation=aggregation, normalizer=norm, kl_coef=0.1)
    kw = dict(name=name, aggregation=aggregation, normalizer=norm, kl_coef=0.1)
    parts = [ours(logp[r], old[r], ref[r], mask[r], adv[r], **kw)
             for r in (slice(0, 3), slice(3, 4))]  # fmt: skip
    assert sum(p[0] for p in parts) == pytest.approx(whole[0], rel=1e-6)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole[1])


# ---- hand-derived references (plain loops over the papers' formulas) ------------------------------------------
def test_kl_estimators_match_their_definitions():
    """Schulman's estimators of KL(π || π_ref), samples from π, r = π_ref / π: k1 = -log r, k2 = (log r)^2 / 2,
    k3 = (r - 1) - log r. Gradients w.r.t. log π: k1 -> 1, k2 -> log π - log π_ref, k3 -> 1 - r."""
    logp, _, ref, mask, _ = _inputs(3)
    for est in ("k1", "k2", "k3"):
        x = logp.clone().requires_grad_(True)
        kl_estimate(x, ref, est).mul(mask).sum().backward()
        for i in range(B):
            for t in range(T):
                if mask[i, t] == 0:
                    continue
                lp, lq = logp[i, t].item(), ref[i, t].item()
                r = math.exp(lq - lp)
                want, dwant = {"k1": (-math.log(r), 1.0), "k2": (0.5 * math.log(r) ** 2, lp - lq),
                               "k3": (r - 1 - math.log(r), 1 - r)}[est]  # fmt: skip
                assert kl_estimate(logp[i, t], ref[i, t], est).item() == pytest.approx(want, rel=1e-5, abs=1e-6)
                assert x.grad[i, t].item() == pytest.approx(dwant, rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("est", ["k1", "k2"])
def test_kl_loss_term_k1_k2_by_hand(est):
    logp, old, ref, mask, adv = _inputs(4)
    coef = 0.2
    v, g, m = ours(
        logp, old, ref, mask, adv, name="reinforce", num_loss_tokens=int(N_TOK), kl_coef=coef, kl_estimator=est
    )
    want, n = 0.0, 0
    for i in range(B):
        for t in range(LENGTHS[i]):
            d = logp[i, t].item() - ref[i, t].item()
            kl = d if est == "k1" else 0.5 * d * d
            want += -adv[i].item() * logp[i, t].item() + coef * kl
            dk = 1.0 if est == "k1" else d
            assert g[i, t].item() == pytest.approx((-adv[i].item() + coef * dk) / N_TOK, rel=1e-5, abs=1e-7)
            n += 1
    assert v == pytest.approx(want / N_TOK, rel=1e-5)
    assert g[mask == 0].abs().max() == 0


def test_reinforce_by_hand_and_equal_to_importance_sampling_on_policy():
    logp, old, ref, mask, adv = _inputs(5)
    v, g, _ = ours(logp, old, ref, mask, adv, name="reinforce", aggregation="seq_mean_token_mean", normalizer=B)
    want = sum(-adv[i].item() * sum(logp[i, t].item() for t in range(n)) / n for i, n in enumerate(LENGTHS)) / B
    assert v == pytest.approx(want, rel=1e-5)
    for i, n in enumerate(LENGTHS):
        assert g[i, :n].tolist() == pytest.approx([-adv[i].item() / n / B] * n, rel=1e-5)
    # On policy (ratio 1) every ratio-based loss has REINFORCE's gradient.
    for name in ("importance_sampling", "grpo", "cispo"):
        _, g2, _ = ours(logp, logp, ref, mask, adv, name=name, aggregation="seq_mean_token_mean", normalizer=B)
        torch.testing.assert_close(g2, g)


def _groups(rewards, gsize):
    return [rewards[i : i + gsize] for i in range(0, len(rewards), gsize)]


def test_advantage_estimators_by_hand():
    rng = random.Random(0)
    gsize = 4
    rewards = [rng.choice([0.0, 0.25, 1.0]) for _ in range(12)] + [0.5] * 4
    want = {"group_mean_std": [], "group_mean": [], "rloo": []}
    for grp in _groups(rewards, gsize):
        mean, std = statistics.fmean(grp), statistics.stdev(grp)
        for j, r in enumerate(grp):
            want["group_mean_std"].append((r - mean) / (std + 1e-6))
            want["group_mean"].append(r - mean)
            others = [grp[k] for k in range(gsize) if k != j]
            want["rloo"].append(r - sum(others) / len(others))
    centred = want["group_mean"]
    mu, sd = statistics.fmean(centred), statistics.stdev(centred)
    want["reinforce_pp"] = [(a - mu) / (sd + 1e-6) for a in centred]
    for name, expected in want.items():
        assert compute_advantages(name, rewards, gsize) == pytest.approx(expected, abs=1e-9), name
    assert compute_advantages("rloo", rewards, gsize)[-4:] == [0.0] * 4  # all-equal group: no signal
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", rewards, gsize)


def test_overlong_shaping_by_hand():
    """DAPO eq. 13: 0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache if within the buffer."""
    L_max, L_cache = 16, 4
    for n in range(1, 17):
        want = 0.0 if n <= L_max - L_cache else ((L_max - L_cache) - n) / L_cache
        assert overlong_penalty(n, L_max, L_cache) == pytest.approx(want)
    assert overlong_penalty(16, 16, 4, penalty=0.5) == pytest.approx(-0.5)
    assert overlong_penalty(16, 16, 0) == 0.0


def test_kl_reward_penalty_by_hand():
    d = Datum.from_completion([4, 5], [6, 7, 8], [-0.5, -1.0, -2.0])
    d.ref_logprobs = [-9.0, -0.7, -1.5, -1.0]  # the prompt position is masked out
    gen = [-0.5, -1.0, -2.0]
    ref = [-0.7, -1.5, -1.0]
    assert kl_penalties([d], "k1") == pytest.approx([sum(g - r for g, r in zip(gen, ref, strict=True))])
    k3 = sum(math.exp(r - g) - 1 - (r - g) for g, r in zip(gen, ref, strict=True))
    assert kl_penalties([d], "k3") == pytest.approx([k3])


def test_informative_groups():
    assert informative_groups([1, 1, 0, 1, 0.5, 0.5, 0, 0], 2) == [1]
    assert informative_groups([0.2, 0.2, 0.2, 0.3], 4) == [0]


# ---- step LossSpec from the config: the global normaliser ---------------------------------------------------
def _data(n_seq=8):
    return [Datum.from_completion([4, 5], [6] * (1 + i % 3), [-1.0] * (1 + i % 3), 1.0) for i in range(n_seq)]


@pytest.mark.parametrize(
    "kw, aggregation, normalizer",
    [
        ({}, "token_mean", 15.0),  # 1+2+3+1+2+3+1+2 loss tokens
        ({"loss": "gspo"}, "seq_mean_token_mean", 8.0),
        ({"advantage": "group_mean", "aggregation": "token_sum_norm"}, "token_sum_norm", 4 * 2 * 8.0),
        ({"aggregation": "seq_mean_token_sum"}, "seq_mean_token_sum", 8.0),
    ],
)
def test_step_loss_spec(kw, aggregation, normalizer):
    cfg = GRPOConfig(prompts_per_step=4, group_size=2, **kw)
    spec = step_loss_spec(cfg, _data(), temperature=0.7, max_tokens=8)
    assert (spec.aggregation, spec.normalizer, spec.temperature) == (aggregation, normalizer, 0.7)


def test_kl_mode_and_tis_reach_the_spec():
    cfg = GRPOConfig(kl_coef=0.1, kl_estimator="k2", tis_cap=2.0, clip_high=0.28)
    spec = step_loss_spec(cfg, _data(), temperature=1.0, max_tokens=8)
    assert (spec.kl_coef, spec.kl_estimator, spec.tis_cap, spec.params) == (0.1, "k2", 2.0, {"clip_high": 0.28})
    cfg = GRPOConfig(kl_coef=0.1, kl_mode="reward")
    assert step_loss_spec(cfg, _data(), temperature=1.0, max_tokens=8).kl_coef == 0.0  # the reward carries it
    assert cfg.needs_reference and not GRPOConfig().needs_reference


def test_loss_spec_requires_a_normaliser_for_non_token_mean():
    with pytest.raises(ValueError, match="aggregation 'seq_mean_token_mean' needs an explicit global normalizer"):
        LossSpec("grpo", aggregation="seq_mean_token_mean")
    assert make_loss_spec("grpo", _data(), aggregation="seq_mean_token_mean").normalizer == 8.0
    assert set(AGGREGATIONS) >= {"token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"}


# ---- bad configurations fail at launch with what to change --------------------------------------------------
@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: GRPOConfig(loss="custom_algorithms:needs_ref"), r"needs reference-model logprobs.*--grpo.kl-coef"),
        (lambda: GRPOConfig(loss="gspo", aggregation="token_mean"),
         r"cannot use .*--grpo.aggregation seq_mean_token_mean"),
        (lambda: GRPOConfig(clip_low=0.0, clip_high=0.0), r"clip range \[1, 1\] is empty or out of order"),
        (lambda: GRPOConfig(clip_low=1.2), r"clip_low=1.2 must be in \[0, 1\)"),
        (lambda: GRPOConfig(loss="reinforce", clip_high=0.28), r"takes no parameter.*remove --grpo.clip-high"),
        (lambda: GRPOConfig(aggregation="median"), r"grpo.aggregation: unknown aggregation 'median'"),
        (lambda: GRPOConfig(loss="ppo2"), r"grpo.loss: unknown loss 'ppo2'"),
        (lambda: GRPOConfig(tis_cap=0.5), r"tis_cap=0.5 must be >= 1"),
        (lambda: GRPOConfig(kl_coef=-1.0), r"kl_coef=-1.0 must be >= 0"),
        (lambda: GRPORunConfig(grpo=GRPOConfig(overlong_buffer=16), generator=GeneratorConfig(max_tokens=16)),
         r"overlong_buffer=16 must be < generator.max_tokens=16"),
    ],
)  # fmt: skip
def test_bad_algorithm_configs_fail_at_launch(make, message):
    with pytest.raises(ConfigError, match=message):
        make()


def test_custom_loss_and_aggregation_by_module_name():
    cfg = GRPOConfig(loss="custom_algorithms:scaled_reinforce", aggregation="custom_algorithms:seq_sqrt",
                     loss_params={"scale": 2.0}, prompts_per_step=4, group_size=2)  # fmt: skip
    spec = step_loss_spec(cfg, _data(), temperature=1.0, max_tokens=8)
    assert spec.normalizer == 8.0 and spec.params == {"scale": 2.0}
    logp, old, ref, mask, adv = _inputs(6)
    v, g, m = ours(
        logp, old, ref, mask, adv, name=spec.name, aggregation=spec.aggregation, normalizer=4.0, params={"scale": 2.0}
    )
    want = sum(
        -2.0 * adv[i].item() * sum(logp[i, t].item() for t in range(n)) / math.sqrt(n) for i, n in enumerate(LENGTHS)
    )
    assert v == pytest.approx(want / 4.0, rel=1e-5)
    assert m["adv_tokens"] == pytest.approx(sum(abs(adv[i].item()) * n for i, n in enumerate(LENGTHS)), rel=1e-5)
    with pytest.raises(ConfigError, match=r"takes no parameter\(s\) \['scael'\]"):
        GRPOConfig(loss="custom_algorithms:scaled_reinforce", loss_params={"scael": 2.0})


# ---- dynamic sampling ---------------------------------------------------------------------------------------
class _StandInCtl:
    """A STAND-IN for the Controller's generate/score (named as such): it makes prompt p's group all-equal exactly
    when p's letters are sorted, so the filter's bookkeeping can be checked against a known answer. The same
    invariant is checked with the real generator and reward actors in test_algorithms_actors.py."""

    def __init__(self):
        self.generated = 0

    def generate(self, prompts, params):
        self.generated += len(prompts)
        out = []
        for p in prompts:
            equal = p[:-1] == sorted(p[:-1])
            out.append([Completion(p, [5 if equal else 5 + j % 2], [-1.0], "stop", 0) for j in range(params.n)])
        return SimpleNamespace(result=lambda: out)

    def score(self, texts, rows, group_size=1):
        # Completion 'b' (token 5) scores 5, 'c' (token 6) scores 6: a group of all-'b' has no signal.
        rewards = [float(ord(t[0]) - ord("a") + 4) for t in texts]
        return SimpleNamespace(result=lambda: [SimpleNamespace(reward=r, parts={}, failures={}) for r in rewards])


def _reverse_setup(**task_kw):
    """The reverse task rendered with its character tokenizer, as the GRPO program prepares it (no processes)."""
    from meshrl.rollout.render import Renderer
    from meshrl.tasks.reverse import ReverseTaskConfig, build_reverse_task
    from meshrl.tasks.setup import TaskSetup

    cfg = ReverseTaskConfig(**task_kw)
    renderer = Renderer(cfg.tokenizer().to_hf())
    return TaskSetup.build(build_reverse_task(cfg), renderer, None, "exact_match", train_budget=16, eval_budget=16)


def test_dynamic_sampling_never_trains_an_all_equal_group():
    from meshrl.controller.rollouts import sample_groups
    from meshrl.data.sampler import EpochSampler
    from meshrl.types import SamplingParams

    setup = _reverse_setup(num_train=40, num_eval=5, min_len=2, max_len=3, alphabet="abcd")
    n = len(setup.train)
    sampling = SamplingParams(n=4, max_tokens=8)
    cfg = GRPOConfig(prompts_per_step=6, group_size=4, dynamic_sampling=True, max_sampling_rounds=5)
    rng, ctl, sampler = random.Random(0), _StandInCtl(), EpochSampler(n, seed=0)
    drawn_more = False
    for _ in range(20):
        got = sample_groups(ctl, setup, sampler, rng, sampling, cfg, dp=2)
        assert len(got.rows) == 6 and len(got.episodes) == 24
        assert all(max(g) != min(g) for g in _groups(got.rewards, 4))  # the invariant
        assert got.prompts_drawn == 6 * got.rounds and got.groups_dropped == got.prompts_drawn - 6
        drawn_more |= got.rounds > 1
    assert drawn_more  # the refill path ran
    # Without dynamic sampling, all-equal groups are kept (one round, as before).
    plain = sample_groups(
        ctl,
        setup,
        EpochSampler(n, seed=0),
        random.Random(0),
        sampling,
        GRPOConfig(prompts_per_step=6, group_size=4),
        dp=2,
    )
    assert plain.rounds == 1 and len(plain.rows) == 6
    # The round cap: with one round the batch may be short, trimmed to what 4 ranks can split (or empty).
    cfg1 = GRPOConfig(prompts_per_step=6, group_size=2, dynamic_sampling=True, max_sampling_rounds=1)
    for seed in range(10):
        got = sample_groups(
            ctl, setup, EpochSampler(n, seed=seed), random.Random(seed), SamplingParams(n=2), cfg1, dp=4
        )
        assert got.rounds == 1 and len(got.episodes) % 4 == 0
        assert all(max(g) != min(g) for g in _groups(got.rewards, 2))


def test_data_smaller_than_one_step_is_said(capsys):
    """8 rows and 16 prompts a step: every step draws rows twice; said once, at the start (issue 31, item 7)."""
    from meshrl.controller.rollouts import Rollouts, SingleTurnRollout
    from meshrl.types import SamplingParams

    setup = _reverse_setup(num_train=8, num_eval=2, min_len=2, max_len=3, alphabet="abcd")
    sampling = SamplingParams(n=2, max_tokens=8)
    Rollouts(_StandInCtl(), setup, SingleTurnRollout(setup, 8), sampling, GRPOConfig(prompts_per_step=16), dp=2)
    assert "the training data has 8 rows, fewer than one step's --grpo.prompts-per-step 16" in capsys.readouterr().err


def test_rubric_watch_says_once_what_the_metrics_hide(capsys):
    """Issue 31, items 1 and 17: a function that scores 0 on every sample and never anything else, and one that
    fails on more than half a step's samples, are said once each on stderr (with the first exception)."""
    from meshrl.controller.rollouts import RubricWatch
    from meshrl.rollout import Row, SingleTurnEnv

    def episode(parts, failures=None):
        e = SingleTurnEnv.episode_of(Row("p"), Completion([1], [2], [-0.1], "stop", 0), "x")
        e.outcome.reward_parts, e.outcome.reward_failures = parts, failures or {}
        return e

    watch = RubricWatch()
    step = [episode({"zero": 0.0, "ok": 1.0, "bad": 0.0}, {"bad": "error: TypeError: boom"}) for _ in range(3)]
    step.append(episode({"zero": 0.0, "ok": 0.0, "bad": 1.0}))
    watch.step(step)
    err = capsys.readouterr().err
    assert "'zero' scored exactly 0 on all 4 samples" in err and "row['answer']" in err
    assert "'bad' failed on 3 of 4 samples this step (scored 0 for them); the first: error: TypeError: boom" in err
    assert "'ok'" not in err
    watch.step(step)  # said once
    assert capsys.readouterr().err == ""
