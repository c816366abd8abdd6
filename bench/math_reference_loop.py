"""A single-process GRPO reference loop on the arithmetic task (meshrl.tasks.arithmetic) — no actors, no vLLM.

The pipeline of the arithmetic preset in miniature, to find its recipe in minutes: a byte-level BPE tokenizer
trained on the task's own training rows (as `meshrl.tasks.setup.new_model_tokenizer` makes it) with a ChatML chat
template; prompts rendered through the template as one user turn; a tiny transformers Qwen3 (the 'tiny' flavor's
shape by default); a supervised warm-up on the demonstrations (`\\boxed{81}` + `<|im_end|>`); then on-policy GRPO
(token-mean of −A·logπ, group_mean_std advantages, AdamW carried over from the warm-up like the trainer's) with the
math-verify reward, and held-out greedy accuracy, mean@k and pass@k before RL and every --eval-every steps.

`--mode sft` continues the supervised warm-up instead of RL (same evaluation, same wall-clock accounting): the
baseline that says whether RL adds anything over more SFT.

    .venv/bin/python bench/math_reference_loop.py --seed 1 --out /tmp/math.jsonl     # the chosen recipe (defaults)

Defaults are the recipe of bench/MATH_NOTES.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F

from meshrl.advantages import compute_advantages
from meshrl.evaluation import greedy_accuracy, summarize
from meshrl.schedule import lr_at
from meshrl.tasks.arithmetic import ArithmeticConfig, build_arithmetic_task
from meshrl.tokenizer import train_bpe_tokenizer

# ---------------------------------------------------------------------------------------------------------------
# reward: math-verify of the completion against the row's gold (parsed from row["answer"], as the `math_verify`
# reward function does); meshrl.rewards' own function is used when it is registered.

_CACHE: dict[tuple[str, str], float] = {}


def _math_verify_direct(completion: str, row: dict) -> float:
    from math_verify import parse, verify

    gold = parse(row["answer"])
    pred = parse(completion)
    return float(bool(gold) and bool(pred) and verify(gold, pred))


def reward_fn(impl: str = "auto"):
    fn = None
    if impl != "direct":
        try:
            from meshrl.rewards import REWARD_FNS

            fn = REWARD_FNS.get("math_verify")
        except Exception:  # noqa: BLE001 - fall back to math_verify itself
            if impl == "meshrl":
                raise
    if fn is None:
        return _math_verify_direct, "math_verify (direct)"
    return fn, "meshrl.rewards.math_verify"


def score(fn, completion: str, row: dict) -> float:
    key = (completion, row["answer"])
    if key not in _CACHE:
        try:
            _CACHE[key] = float(fn(completion, row))
        except Exception:  # noqa: BLE001 - the reward processes count a failing reward as 0
            _CACHE[key] = 0.0
    return _CACHE[key]


# ---------------------------------------------------------------------------------------------------------------
# model and sampling


def build_model(tok, *, layers: int, hidden: int, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from meshrl.models.qwen3 import hf_config_dict

    d = hf_config_dict("tiny", len(tok))
    if hidden != d["hidden_size"] or layers != d["num_hidden_layers"]:
        heads = max(hidden // 32, 1)
        d.update(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(heads // 2, 1),
            head_dim=32,
        )
    for k in ("layer_types", "max_window_layers"):
        d.pop(k, None)
    d.update(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**d))


@torch.no_grad()
def sample(model, prompts: list[list[int]], *, max_tokens: int, temperature: float, eos: int, gen=None):
    """Completions (ending at eos, included, or max_tokens) for each prompt; prompts of one length run as one batch
    with a KV cache."""
    out: list[list[int] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([prompts[i] for i in idx], device=model.device)
        res = model(ids, use_cache=True)
        cache, logits = res.past_key_values, res.logits[:, -1]
        toks = []
        done = torch.zeros(len(idx), dtype=torch.bool, device=model.device)
        for _ in range(max_tokens):
            if temperature == 0:
                nxt = logits.argmax(-1)
            else:
                nxt = torch.multinomial(F.softmax(logits.float() / temperature, -1), 1, generator=gen).squeeze(-1)
            toks.append(torch.where(done, torch.full_like(nxt, eos), nxt))
            done |= nxt == eos
            if done.all():
                break
            res = model(nxt[:, None], past_key_values=cache, use_cache=True)
            cache, logits = res.past_key_values, res.logits[:, -1]
        rows = torch.stack(toks, 1).tolist()
        for j, i in enumerate(idx):
            row = rows[j]
            out[i] = row[: row.index(eos) + 1] if eos in row else row
    return out  # type: ignore[return-value]


def token_logprobs(model, seqs: list[list[int]], starts: list[int], pad: int):
    """Per-token logprobs of every sequence from position `start` on (right-padded batch) and the loss mask."""
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=model.device)
    mask = torch.zeros(len(seqs), width - 1, device=model.device)
    for i, (s, st) in enumerate(zip(seqs, starts, strict=True)):
        mask[i, st - 1 : len(s) - 1] = 1.0
    logits = model(ids).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp, mask


def texts_of(tok, comps: list[list[int]], eos: int) -> list[str]:
    """What the verifiers read: the completion without its final eos, special tokens skipped."""
    return [tok.decode(c[:-1] if c and c[-1] == eos else c, skip_special_tokens=True) for c in comps]


# ---------------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("task (meshrl.tasks.arithmetic.ArithmeticConfig)")
    g.add_argument("--num-train", type=int, default=14000)
    g.add_argument("--num-eval", type=int, default=500)
    g.add_argument("--task-seed", type=int, default=1234)
    g.add_argument("--operations", default="+-")
    g.add_argument("--min-value", type=int, default=0)
    g.add_argument("--max-value", type=int, default=99)
    g.add_argument("--num-operands", type=int, default=2)
    g.add_argument("--allow-negative", action="store_true")
    g.add_argument("--show-work", action="store_true")
    g = ap.add_argument_group("model")
    g.add_argument("--layers", type=int, default=2)
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--vocab", type=int, default=512, help="BPE vocabulary size (model.bpe_vocab_size)")
    g.add_argument(
        "--bpe-role-names",
        action="store_true",
        help="also train the BPE on the chat roles ('user', 'assistant'): prompts ~10 tokens shorter (not what "
        "meshrl.tasks.setup.new_model_tokenizer does today)",
    )
    g = ap.add_argument_group("warm-up and RL")
    g.add_argument("--warmup-steps", type=int, default=800)
    g.add_argument("--warmup-batch", type=int, default=64)
    g.add_argument("--warmup-lr", type=float, default=1e-3)
    g.add_argument("--mode", choices=("rl", "sft"), default="rl", help="after the warm-up: GRPO, or more SFT")
    g.add_argument("--rl-steps", type=int, default=200, help="RL steps (--mode sft: SFT steps)")
    g.add_argument("--lr", type=float, default=2e-4, help="RL peak lr (optim.lr); --mode sft: its lr")
    g.add_argument("--schedule", default="constant", help="RL lr schedule (optim.schedule): constant/cosine/linear")
    g.add_argument("--rl-lr-warmup", type=int, default=0, help="linear lr warm-up steps of RL (optim.warmup_steps)")
    g.add_argument("--beta2", type=float, default=0.99, help="AdamW beta2 of both phases (optim.betas[1])")
    g.add_argument(
        "--fresh-optimizer", action="store_true", help="new AdamW state for RL (diagnostic: the trainer keeps it)"
    )
    g.add_argument("--prompts", type=int, default=128)
    g.add_argument("--group", type=int, default=8)
    g.add_argument("--max-tokens", type=int, default=8)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--advantage", default="group_mean_std")
    g.add_argument("--grad-clip", type=float, default=1.0)
    g = ap.add_argument_group("evaluation")
    g.add_argument("--eval-every", type=int, default=50)
    g.add_argument("--eval-samples", type=int, default=8, help="k of mean@k / pass@k (0: greedy only)")
    g.add_argument("--eval-max-tokens", type=int, default=0, help="0: --max-tokens")
    g = ap.add_argument_group("run")
    g.add_argument("--seed", type=int, default=0, help="model init, batches and sampling")
    g.add_argument("--threads", type=int, default=1)
    g.add_argument("--device", default="cpu", help="cpu (what the preset runs on) or cuda (faster sweeps)")
    g.add_argument("--reward-impl", choices=("auto", "meshrl", "direct"), default="auto")
    g.add_argument("--out", default="", help="append the result as one JSON line here")
    g.add_argument("--tag", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    t_start, cpu_start = time.perf_counter(), time.process_time()

    task = build_arithmetic_task(
        ArithmeticConfig(
            num_train=a.num_train,
            num_eval=a.num_eval,
            seed=a.task_seed,
            operations=a.operations,
            min_value=a.min_value,
            max_value=a.max_value,
            num_operands=a.num_operands,
            allow_negative=a.allow_negative,
            show_work=a.show_work,
        )
    )
    # The tokenizer of a new model: BPE on the training rows' prompts and answers (tasks.setup.new_model_tokenizer).
    texts = [r.prompt for r in task.train] + [r.answer for r in task.train]
    if a.bpe_role_names:
        texts += ["user\n", "assistant\n"] * 10
    tok = train_bpe_tokenizer(texts, vocab_size=a.vocab)
    eos, pad = tok.eos_token_id, tok.pad_token_id

    def render(row) -> list[int]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": row.prompt}], tokenize=False, add_generation_prompt=True
        )
        return tok(text, add_special_tokens=False)["input_ids"]

    train_prompts = [render(r) for r in task.train]
    eval_prompts = [render(r) for r in task.eval]
    demos = [tok(r.answer, add_special_tokens=False)["input_ids"] + [eos] for r in task.train]
    train_views = [r.verifier_view() for r in task.train]
    eval_views = [r.verifier_view() for r in task.eval]
    # difficulty of a held-out question: the digits of its longest operand
    eval_digits = [max(len(t) for t in r.prompt[len("What is ") : -1].split()[::2]) for r in task.eval]
    fn, fn_name = reward_fn(a.reward_impl)
    eval_max_tokens = a.eval_max_tokens or a.max_tokens
    longest_demo = max(map(len, demos))
    if longest_demo > a.max_tokens:
        print(f"WARNING: the longest demonstration is {longest_demo} tokens > --max-tokens {a.max_tokens}")

    model = build_model(tok, layers=a.layers, hidden=a.hidden, seed=a.seed).to(a.device)
    n_params = sum(p.numel() for p in model.parameters())
    rng = random.Random(a.seed)
    gen = torch.Generator(a.device).manual_seed(a.seed)
    eval_gen_seed = 10_000 + a.seed
    print(
        f"task: {len(task.train)} train / {len(task.eval)} held-out, e.g. {task.train[0].prompt!r} -> "
        f"{task.train[0].answer!r}; vocab {len(tok)}; prompt tokens {min(map(len, train_prompts))}-"
        f"{max(map(len, train_prompts))}, demonstration tokens {min(map(len, demos))}-{longest_demo} (with eos); "
        f"params {n_params:,}; reward {fn_name}",
        flush=True,
    )
    timing = {"warmup": 0.0, "rl": 0.0, "eval": 0.0}  # wall seconds per phase
    cpu = {"warmup": 0.0, "rl": 0.0, "eval": 0.0}  # this process's CPU seconds (= wall on an idle machine, 1 thread)
    rl_parts = {"sample": 0.0, "reward": 0.0, "train": 0.0}  # CPU seconds of the RL steps, by part

    def evaluate(step: int) -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        model.eval()
        greedy = texts_of(tok, sample(model, eval_prompts, max_tokens=eval_max_tokens, temperature=0.0, eos=eos), eos)
        correct = [score(fn, t, v) >= 1 for t, v in zip(greedy, eval_views, strict=True)]
        rec = {"step": step, "greedy": greedy_accuracy(correct)}
        by_digits: dict[int, list[bool]] = {}
        for d, c in zip(eval_digits, correct, strict=True):
            by_digits.setdefault(d, []).append(c)
        rec["greedy_by_digits"] = {d: round(greedy_accuracy(v), 3) for d, v in sorted(by_digits.items())}
        if a.eval_samples:
            k = a.eval_samples
            egen = torch.Generator(a.device).manual_seed(eval_gen_seed)
            comps = sample(
                model,
                [p for p in eval_prompts for _ in range(k)],
                max_tokens=eval_max_tokens,
                temperature=a.temperature,
                eos=eos,
                gen=egen,
            )
            texts = texts_of(tok, comps, eos)
            correct = [[score(fn, texts[i * k + j], v) >= 1 for j in range(k)] for i, v in enumerate(eval_views)]
            rec.update(summarize(correct, (1, k)))
        rec["example"] = [task.eval[0].prompt, greedy[0]]
        timing["eval"] += time.perf_counter() - t0
        cpu["eval"] += time.process_time() - c0
        rec["wall"] = time.perf_counter() - t_start
        return rec

    def fmt(rec: dict) -> str:
        s = f"greedy {rec['greedy']:.3f} {rec['greedy_by_digits']}"
        if a.eval_samples:
            k = a.eval_samples
            s += f"  mean@{k} {rec[f'mean@{k}']:.3f}  pass@{k} {rec[f'pass@{k}']:.3f}"
        return s

    def new_optimizer():
        return torch.optim.AdamW(model.parameters(), lr=a.warmup_lr, betas=(0.9, a.beta2), eps=1e-8, weight_decay=0.0)

    opt = new_optimizer()
    grad_norms: dict[str, list[float]] = {"warmup": [], "rl": []}

    def clip_and_step(phase: str) -> None:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip if a.grad_clip else float("inf"))
        grad_norms[phase].append(float(norm))
        opt.step()

    def sft_step(lr: float, phase_is_warmup: bool = True) -> float:
        for grp in opt.param_groups:
            grp["lr"] = lr
        idx = rng.sample(range(len(task.train)), a.warmup_batch)
        model.train()
        lp, mask = token_logprobs(
            model, [train_prompts[i] + demos[i] for i in idx], [len(train_prompts[i]) for i in idx], pad
        )
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        clip_and_step("warmup" if phase_is_warmup else "rl")
        return loss.item()

    t0, c0 = time.perf_counter(), time.process_time()
    loss = float("nan")
    for step in range(a.warmup_steps):
        # the trainer's schedule: cosine from the peak to 10 % (meshrl.schedule.lr_at, min_lr_ratio=0.1)
        lr = lr_at(step, peak_lr=a.warmup_lr, total_steps=a.warmup_steps, schedule="cosine", min_lr_ratio=0.1)
        loss = sft_step(lr)
    timing["warmup"] = time.perf_counter() - t0
    cpu["warmup"] = time.process_time() - c0
    curve = [evaluate(0)]
    gw = statistics.fmean(grad_norms["warmup"][-10:]) if grad_norms["warmup"] else float("nan")
    print(
        f"warm-up {a.warmup_steps} steps (loss {loss:.3f}, |g| {gw:.2f}, {timing['warmup']:.0f}s): {fmt(curve[0])}",
        flush=True,
    )
    print(f"   e.g. {curve[0]['example']}", flush=True)

    if a.fresh_optimizer:
        opt = new_optimizer()
    rewards_per_step: list[float] = []
    lengths: list[float] = []
    for step in range(a.rl_steps):
        t0, c0 = time.perf_counter(), time.process_time()
        lr = lr_at(step, peak_lr=a.lr, total_steps=a.rl_steps, schedule=a.schedule, warmup_steps=a.rl_lr_warmup)
        if a.mode == "sft":
            rewards_per_step.append(-sft_step(lr, phase_is_warmup=False))
        else:
            for grp in opt.param_groups:
                grp["lr"] = lr
            idx = rng.sample(range(len(task.train)), a.prompts)
            prompts = [train_prompts[i] for i in idx for _ in range(a.group)]
            views = [train_views[i] for i in idx for _ in range(a.group)]
            model.eval()
            c1 = time.process_time()
            comps = sample(model, prompts, max_tokens=a.max_tokens, temperature=a.temperature, eos=eos, gen=gen)
            c2 = time.process_time()
            rewards = [score(fn, t, v) for t, v in zip(texts_of(tok, comps, eos), views, strict=True)]
            c3 = time.process_time()
            rl_parts["sample"] += c2 - c1
            rl_parts["reward"] += c3 - c2
            adv = torch.tensor(
                compute_advantages(a.advantage, rewards, a.group), dtype=torch.float32, device=model.device
            )
            model.train()
            lp, mask = token_logprobs(
                model, [p + c for p, c in zip(prompts, comps, strict=True)], list(map(len, prompts)), pad
            )
            loss = -(lp * mask * adv[:, None]).sum() / mask.sum()
            opt.zero_grad()
            loss.backward()
            clip_and_step("rl")
            rl_parts["train"] += time.process_time() - c3
            rewards_per_step.append(statistics.fmean(rewards))
            lengths.append(statistics.fmean(map(len, comps)))
        timing["rl"] += time.perf_counter() - t0
        cpu["rl"] += time.process_time() - c0
        if (step + 1) % a.eval_every == 0 or step + 1 == a.rl_steps:
            curve.append(evaluate(step + 1))
            what = "reward" if a.mode == "rl" else "-loss"
            curve[-1]["reward"] = statistics.fmean(rewards_per_step[-10:])
            curve[-1]["grad_norm"] = statistics.fmean(grad_norms["rl"][-10:])
            print(
                f"step {step + 1}: {what}(last 10) {statistics.fmean(rewards_per_step[-10:]):.3f}  {fmt(curve[-1])}"
                f"  |g| {curve[-1]['grad_norm']:.2f}"
                f"  ({time.perf_counter() - t_start:.0f}s)",
                flush=True,
            )
    first = statistics.fmean(rewards_per_step[:10]) if rewards_per_step else float("nan")
    last = statistics.fmean(rewards_per_step[-10:]) if rewards_per_step else float("nan")
    before, after = curve[0], curve[-1]
    result = dict(
        vars(a),
        params=n_params,
        vocab_size=len(tok),
        reward_fn=fn_name,
        prompt_tokens=statistics.fmean(map(len, train_prompts)),
        completion_tokens_first10=statistics.fmean(lengths[:10]) if lengths else None,
        completion_tokens_last10=statistics.fmean(lengths[-10:]) if lengths else None,
        reward_first10=first,
        reward_last10=last,
        before={k: v for k, v in before.items() if k != "example"},
        after={k: v for k, v in after.items() if k != "example"},
        curve=[{k: v for k, v in c.items() if k != "example"} for c in curve],
        grad_norm_warmup_last10=statistics.fmean(grad_norms["warmup"][-10:]) if grad_norms["warmup"] else None,
        grad_norm_rl_first10=statistics.fmean(grad_norms["rl"][:10]) if grad_norms["rl"] else None,
        timing=timing,
        cpu_timing=cpu,
        rl_cpu_parts=rl_parts,
        seconds=time.perf_counter() - t_start,
        cpu_seconds=time.process_time() - cpu_start,
    )
    print(
        f"\n| step | greedy | mean@{a.eval_samples} | pass@{a.eval_samples} | wall s |\n| --- | --- | --- | --- | --- |"
    )
    for c in curve:
        k = a.eval_samples
        print(
            f"| {c['step']} | {c['greedy']:.3f} | {c.get(f'mean@{k}', float('nan')):.3f} | "
            f"{c.get(f'pass@{k}', float('nan')):.3f} | {c['wall']:.0f} |"
        )
    print(
        f"RESULT {a.tag} reward {first:.3f} -> {last:.3f}; greedy {before['greedy']:.3f} -> {after['greedy']:.3f}"
        + (
            f"; mean@{a.eval_samples} {before[f'mean@{a.eval_samples}']:.3f} -> {after[f'mean@{a.eval_samples}']:.3f}"
            if a.eval_samples
            else ""
        )
        + f"; {result['seconds']:.0f}s wall, {result['cpu_seconds']:.0f}s cpu "
        + f" (cpu: warm-up {cpu['warmup']:.0f}, rl {cpu['rl']:.0f} = sample {rl_parts['sample']:.0f} + reward "
        f"{rl_parts['reward']:.0f} + train {rl_parts['train']:.0f}, eval {cpu['eval']:.0f})"
    )
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
