"""A single-process GRPO reference loop on the built-in task — no actors, no vLLM, no FSDP.

Why it exists: to tell "the RL recipe does not learn" apart from "the distributed system is wrong". It uses the
same task, tokenizer, rewards and advantage code as the main job, a plain transformers Qwen3, plain AdamW and
the on-policy GRPO loss (token-mean of −A·logπ; with one optimiser step per batch the clipped ratio is 1), so a
preset can be tried here in a fraction of the main job's time and its curve compared with the real run's.

    .venv/bin/python bench/rl_reference_loop.py --layers 2 --hidden 128 --warmup-steps 60 --rl-steps 120
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from math_reference_loop import sample  # the one KV-cached sampler of both reference loops (bench/ is on sys.path)
from transformers import Qwen3Config, Qwen3ForCausalLM

from meshrl.advantages import compute_advantages
from meshrl.rewards import Rubric, ScoringConfig
from meshrl.tasks.reverse import ReverseTaskConfig, build_reverse_task


class CharTask:
    """The reverse task with its character tokenizer, tokenized by hand (the programs render with the model's)."""

    def __init__(self, cfg: ReverseTaskConfig, weights: dict[str, float]) -> None:
        task = build_reverse_task(cfg)
        self.train, self.eval, self.tokenizer = task.train, task.eval, cfg.tokenizer()
        self.rewards = Rubric(weights, ScoringConfig(num_threads=1))

    def prompt_ids(self, rows) -> list[list[int]]:
        return [self.tokenizer.encode(r.prompt) for r in rows]

    def demonstration_ids(self, row) -> tuple[list[int], list[int]]:
        return self.tokenizer.encode(row.prompt), self.tokenizer.encode(row.answer) + [self.tokenizer.eos_id]

    def reward(self, text: str, row) -> float:
        return self.rewards.score([text], [row.verifier_view()])[0].reward


def build_model(vocab: int, tok, *, layers: int, hidden: int, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 32, 1),
        num_key_value_heads=max(hidden // 64, 1),
        head_dim=32,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_id,
        pad_token_id=tok.pad_id,
    )
    return Qwen3ForCausalLM(cfg)


def token_logprobs(model, seqs: list[list[int]], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token logprobs of every sequence from position `start` on (right-padded batch) and the loss mask."""
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.zeros(len(seqs), width - 1)
    for i, (s, st) in enumerate(zip(seqs, starts, strict=True)):
        mask[i, st - 1 : len(s) - 1] = 1.0
    logits = model(ids).logits[:, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp, mask


def accuracy(model, task, examples, eos: int) -> float:
    comps = sample(model, task.prompt_ids(examples), max_tokens=8, temperature=0.0, eos=eos)
    texts = [task.tokenizer.decode([t for t in c if t != eos]) for c in comps]
    return sum(t == e.answer for t, e in zip(texts, examples, strict=True)) / len(examples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--alphabet", default="abcdefgh")
    ap.add_argument("--min-len", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=5)
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--warmup-steps", type=int, default=60)
    ap.add_argument("--warmup-lr", type=float, default=3e-3)
    ap.add_argument("--rl-steps", type=int, default=120)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--reward", default="char_match", help="name, or name=weight,name=weight")
    ap.add_argument("--advantage", default="group_mean_std")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    weights = {kv.split("=")[0]: float(kv.split("=")[1]) if "=" in kv else 1.0 for kv in a.reward.split(",")}
    task = CharTask(
        ReverseTaskConfig(alphabet=a.alphabet, min_len=a.min_len, max_len=a.max_len, num_train=a.num_train), weights
    )
    tok, eos = task.tokenizer, task.tokenizer.eos_id
    model = build_model(tok.vocab_size, tok, layers=a.layers, hidden=a.hidden, seed=a.seed)
    n_params = sum(p.numel() for p in model.parameters())
    rng = random.Random(a.seed)
    t_start = time.perf_counter()

    opt = torch.optim.AdamW(model.parameters(), lr=a.warmup_lr, betas=(0.9, 0.999), weight_decay=0.0)
    for step in range(a.warmup_steps):
        lr = a.warmup_lr * (0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(step / a.warmup_steps * 3.14159)).item()))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = [task.demonstration_ids(e) for e in rng.sample(task.train, 64)]
        lp, mask = token_logprobs(model, [p + r for p, r in batch], [len(p) for p, _ in batch])
        loss = -(lp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    acc0 = accuracy(model, task, task.eval, eos)
    print(
        f"params {n_params:,}  warm-up {a.warmup_steps} steps: held-out {acc0:.2f}",
        f"({time.perf_counter() - t_start:.0f}s)",
    )

    for g in opt.param_groups:  # one optimiser for both phases, as in the main job's trainer
        g["lr"] = a.lr
    rewards_per_step, curve = [], [(0, acc0)]
    for step in range(a.rl_steps):
        examples = rng.sample(task.train, a.prompts)
        prompts = [p for p in task.prompt_ids(examples) for _ in range(a.group)]
        model.eval()
        comps = sample(model, prompts, max_tokens=8, temperature=1.0, eos=eos)
        rewards = [
            task.reward(tok.decode([t for t in c if t != eos]), e)
            for c, e in zip(comps, [e for e in examples for _ in range(a.group)], strict=True)
        ]
        adv = torch.tensor(compute_advantages(a.advantage, rewards, a.group), dtype=torch.float32)
        model.train()
        lp, mask = token_logprobs(model, [p + c for p, c in zip(prompts, comps, strict=True)], list(map(len, prompts)))
        loss = -(lp * mask * adv[:, None]).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rewards_per_step.append(statistics.fmean(rewards))
        if (step + 1) % a.eval_every == 0:
            curve.append((step + 1, accuracy(model, task, task.eval, eos)))
            print(
                f"step {step + 1}: reward(last 5) {statistics.fmean(rewards_per_step[-5:]):.3f}",
                f"held-out {curve[-1][1]:.2f}",
                flush=True,
            )
    first, last = statistics.fmean(rewards_per_step[:5]), statistics.fmean(rewards_per_step[-5:])
    acc1 = accuracy(model, task, task.eval, eos)
    result = dict(
        vars(a),
        params=n_params,
        reward_first5=first,
        reward_last5=last,
        acc_before=acc0,
        acc_after=acc1,
        curve=curve,
        seconds=time.perf_counter() - t_start,
    )
    print(
        f"RESULT reward {first:.3f} -> {last:.3f} (gain {last - first:+.3f}); held-out {acc0:.2f} -> {acc1:.2f}; "
        f"{result['seconds']:.0f}s"
    )
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
