"""A task made ready for a run: the model it trains, its splits rendered once with the model's tokenizer, and the
reward functions that judge it — everything checked before any actor process starts.

    task = build_task(cfg, train_rows=rows)
    model_dir = ensure_model(cfg.model, cfg.reverse, task, run_dir)
    setup = TaskSetup.prepare(cfg, task, model_dir)
    setup.train.prompt_ids[i], setup.train.views[i]        # what the generators and verifiers get
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshrl.errors import ConfigError
from meshrl.render import Renderer
from meshrl.tasks.base import Row, Task


@dataclass
class PromptSet:
    """One split of a task, rendered once: prompt ids and verifier views per row. Prompts over the token budget
    are dropped and counted (never truncated: a cut prompt asks a different question)."""

    rows: list[Row]
    prompt_ids: list[list[int]]
    views: list[dict[str, Any]]
    dropped: int = 0
    budget: int = 0

    @classmethod
    def render(cls, rows: Sequence[Row], renderer: Renderer, budget: int, what: str) -> PromptSet:
        kept, ids, dropped = [], [], 0
        for i, row in enumerate(rows):
            try:
                prompt = renderer.prompt_ids(row)
            except Exception as e:  # noqa: BLE001 - a template that cannot render a row: name the row
                raise ValueError(f"{what} row {i + 1}: cannot render its prompt: {e}") from e
            if len(prompt) > budget:
                dropped += 1
                continue
            kept.append(row)
            ids.append(prompt)
        if not kept:
            raise ConfigError(
                f"every one of the {len(rows)} {what} prompts is longer than the {budget}-token prompt budget "
                "(generator.max_model_len - generator.max_tokens); raise --generator.max-model-len"
            )
        return cls(kept, ids, [r.verifier_view() for r in kept], dropped, budget)

    def __len__(self) -> int:
        return len(self.rows)

    def describe(self, what: str) -> str:
        note = f", {self.dropped} dropped (prompt over {self.budget} tokens)" if self.dropped else ""
        return f"{what}: {len(self)} prompts{note}"


def reward_weights(
    spec: str, task: Task, reward_fns: Mapping[str, Callable] | None = None
) -> tuple[dict[str, float], dict[str, Callable]]:
    """(name -> weight, name -> callable) from a reward spec, 'task' meaning the task's own verifier. Functions
    given from Python (`reward_fns`) join with weight 1.0 unless the spec weighs them."""
    from meshrl.rewards import parse_reward_spec

    weights: dict[str, float] = {}
    for name, w in parse_reward_spec(spec).items():
        if name == "task":
            if not task.verifier:
                raise ConfigError(
                    f"--reward names 'task', but task {task.name!r} has no verifier of its own; name a reward "
                    "function instead (e.g. math_verify, exact, or package.module:function)"
                )
            name = task.verifier
        weights[name] = weights.get(name, 0.0) + w
    fns = dict(reward_fns or {})
    for name in fns:
        weights.setdefault(name, 1.0)
    return weights, fns


@dataclass
class TaskSetup:
    """What a run needs from its task, ready: renderer, rendered splits, reward functions and the verifier."""

    task: Task
    renderer: Renderer
    train: PromptSet
    eval: PromptSet
    rewards: Any  # meshrl.rewards.RewardSet
    verifier: str  # the reward function whose value >= 1 marks a completion correct
    notes: list[str] = field(default_factory=list)

    @classmethod
    def prepare(
        cls,
        cfg: Any,
        task: Task,
        model_dir: str | Path,
        *,
        reward_fns: Mapping[str, Callable] | None = None,
        eval_max_tokens: int | None = None,
    ) -> TaskSetup:
        """`cfg`: a run config with model, generator, render, scoring, reward and (optionally) eval sections. The
        model directory and its trainer backend are checked before this, first thing (`check_model_dir`)."""
        from meshrl.rewards import RewardSet

        renderer = Renderer.from_model_dir(model_dir, cfg.render)
        check_tokenizer_fits(renderer, model_dir)
        given = getattr(cfg, "reward", None)  # SFT runs evaluate with the task's own rewards
        spec = given or task.reward
        if given is None and reward_fns:
            spec = ""  # functions given from Python replace the task's default rewards
        weights, fns = reward_weights(spec, task, reward_fns) if spec else reward_weights("", task, reward_fns)
        eval_cfg = getattr(cfg, "eval", None)
        verifier = (eval_cfg.verifier if eval_cfg is not None else None) or task.verifier or next(iter(weights))
        if verifier == "task":
            verifier = task.verifier
        weights.setdefault(verifier, 0.0)  # measured on every sample (accuracy), weighs nothing unless named
        rewards = RewardSet(weights, cfg.scoring, fns=fns)
        gen = cfg.generator
        return cls.build(
            task,
            renderer,
            rewards,
            verifier,
            train_budget=gen.max_model_len - gen.max_tokens,
            eval_budget=gen.max_model_len - (eval_max_tokens or gen.max_tokens),
        )

    @classmethod
    def prepare_episodes(
        cls,
        cfg: Any,
        task: Task,
        model_dir: str | Path,
        *,
        reward_fns: Mapping[str, Callable] | None = None,
        eval_max_tokens: int | None = None,
    ) -> TaskSetup:
        """For a run with an environment (`cfg.env`): the environment scores its episodes, so no reward functions;
        the prompt budget leaves room for the first turn within the episode's token limit."""
        if reward_fns:
            raise ConfigError(
                f"reward functions {sorted(reward_fns)} were given with --env {cfg.env.name}: an environment gives its "
                "episodes' rewards itself; score inside its step() instead"
            )
        renderer = Renderer.from_model_dir(model_dir, cfg.render)
        check_tokenizer_fits(renderer, model_dir)
        gen = cfg.generator
        episode_budget = cfg.env.max_tokens or gen.max_model_len
        return cls.build(
            task,
            renderer,
            None,
            "env",
            train_budget=episode_budget - gen.max_tokens,
            eval_budget=episode_budget - (eval_max_tokens or gen.max_tokens),
        )

    @classmethod
    def build(
        cls, task: Task, renderer: Renderer, rewards: Any, verifier: str, *, train_budget: int, eval_budget: int
    ) -> TaskSetup:
        """From parts made by hand (`prepare` makes them from a run config): renders both splits."""
        train = PromptSet.render(task.train, renderer, train_budget, "train")
        held_out = PromptSet.render(task.eval, renderer, eval_budget, "eval")
        for split, what in ((train, "train"), (held_out, "eval")):
            total = len(split) + split.dropped
            if split.dropped >= 0.1 * total:  # a silent loss of this size would change what the run trains on
                print(
                    f"[meshrl] WARNING: {split.dropped} of {total} {what} prompts ({split.dropped / total:.0%}) are "
                    f"longer than the {split.budget}-token prompt budget and were dropped; raise "
                    "--generator.max-model-len (or lower --generator.max-tokens) to keep them",
                    file=sys.stderr,
                    flush=True,
                )
        notes = [train.describe("train"), held_out.describe("eval")]
        notes += [f"skipped bad rows, {reason}: {n}" for reason, n in task.skipped.items()]
        return cls(task, renderer, train, held_out, rewards, verifier, notes)

    def describe_rewards(self) -> str:
        if self.rewards is None:
            return "the environment's"
        return ", ".join(f"{name}={weight:g}" for name, weight in self.rewards.weights.items())

    def demonstrations(self, max_len: int) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
        """(train indices with a demonstration that fits in `max_len` tokens, their (prompt ids, response ids))
        for a supervised warm-up."""
        keep, demos = [], []
        for i, (row, prompt) in enumerate(zip(self.train.rows, self.train.prompt_ids, strict=True)):
            if row.answer is None:
                continue
            response = self.renderer.encode(self.task.demonstration(row)) + [self.renderer.eos_id]
            if len(prompt) + len(response) <= max_len:
                keep.append(i)
                demos.append((prompt, response))
        if not keep:
            raise ConfigError(
                f"task {self.task.name!r}: no training row has a reference answer that fits in {max_len} tokens "
                "with its prompt, so there is nothing to warm up on; set --warmup.steps 0"
            )
        return keep, demos


def check_tokenizer_fits(renderer: Renderer, model_dir: str | Path) -> None:
    """A tokenizer whose ids run past the model's vocabulary belongs to another model: refuse at launch."""
    from meshrl.models.hf_config import read_config

    hf = read_config(model_dir)
    vocab = hf.get("vocab_size")
    n = len(renderer.tokenizer)
    if isinstance(vocab, int) and n > vocab:
        raise ConfigError(
            f"the tokenizer in {model_dir} has {n} tokens but the model's vocabulary has {vocab}: they belong to "
            "different models. Put the model's own tokenizer files next to its weights"
        )


def ensure_model(cfg: Any, task: Task | None, run_path: Path) -> str:
    """The checkpoint a run starts from: `cfg.model.path`, or a new random model of `cfg.model.flavor` written into
    the run directory with `new_model_tokenizer` (a resumed run finds it there already)."""
    model_cfg = cfg.model
    if model_cfg.path is not None:
        check_model_dir(model_cfg.path)
        return str(model_cfg.path)
    model_dir = run_path / "base_model"
    if not (model_dir / "config.json").exists():
        from meshrl.models.qwen3 import create_random_checkpoint

        tokenizer = new_model_tokenizer(cfg, task)
        create_random_checkpoint(model_dir, flavor=model_cfg.flavor, tokenizer=tokenizer, seed=model_cfg.seed)
    return str(model_dir)


def check_model_dir(path: str | Path, backend: str | None = None) -> None:
    """`--model.path` names a whole HF checkpoint directory that `backend` (if given) can train; else ConfigError
    naming the file and what is wrong: config.json parses and has its model_type and vocab_size, every weight
    file is there and no safetensors file is shorter than its header says (headers only: no tensor is read)."""
    if not Path(path).is_dir():
        raise ConfigError(
            f"--model.path {path}: {'not a directory' if Path(path).exists() else 'no such directory'}; give an HF "
            "checkpoint directory (config.json, weights, tokenizer files)"
        )
    if not Path(path, "config.json").is_file():
        raise ConfigError(
            f"--model.path {path}: no config.json there; give an HF checkpoint directory (config.json, weights, "
            "tokenizer files)"
        )
    from meshrl.models.hf_config import check_config_fields, check_weights

    check_config_fields(path)
    check_weights(path)
    if backend is not None:
        from meshrl.models.hf_config import check_backend_supports

        check_backend_supports(str(path), backend)


def check_run_inputs(cfg: Any, *, generator: bool = True) -> None:
    """What can be known wrong about a run before any process starts, refused first thing in each program's main
    with a ConfigError naming the flag, the file and the numbers: the checkpoint directory (`check_model_dir`),
    trainer / reference process counts this machine cannot run (`check_process_counts`), and lengths past the
    model's context (`check_context`; `generator`: whether the run starts generators, whose max_model_len counts)."""
    trainer = getattr(cfg, "trainer", None)
    if cfg.model.path is not None:
        check_model_dir(cfg.model.path, cfg.model.backend if trainer is not None else None)
    check_process_counts(cfg)
    check_context(cfg, generator=generator)


def model_context(model_cfg: Any) -> tuple[int, str] | None:
    """(the model's context length in positions, where that is written) for `--model.path` or, without one, the new
    model of `--model.flavor`; None when the config gives no context length (nothing to check against)."""
    from meshrl.models.hf_config import context_length, read_config

    if model_cfg.path is not None:
        found = context_length(read_config(model_cfg.path))
        if found is None:
            return None
        return found[1], f"{found[0]}={found[1]} in {Path(model_cfg.path) / 'config.json'}"
    from meshrl.models.qwen3 import TINY_HF_CONFIG, hf_config_dict

    hf = TINY_HF_CONFIG if model_cfg.flavor == "tiny" else hf_config_dict(model_cfg.flavor, vocab_size=1)
    n = hf["max_position_embeddings"]
    return n, f"max_position_embeddings={n} of the new --model.flavor {model_cfg.flavor} model"


def check_context(cfg: Any, *, generator: bool = True) -> None:
    """No sequence length a run is configured for may pass the model's context: positions past it have no embedding
    (learned tables index out of range; RoPE models run but were never trained there), and the failure would come
    mid-run, at the first long batch, and again on resume."""
    known = model_context(cfg.model)
    if known is None:
        return
    context, where = known
    lengths = []
    if generator and getattr(cfg, "generator", None) is not None:
        lengths.append(("--generator.max-model-len", cfg.generator.max_model_len))
    data = getattr(cfg, "data", None)
    for field_name, flag in (("max_seq_len", "--data.max-seq-len"), ("pack_len", "--data.pack-len")):
        value = getattr(data, field_name, None)
        if value is not None:
            lengths.append((flag, value))
    for flag, value in lengths:
        if value > context:
            raise ConfigError(
                f"{flag} {value} is longer than the model's context of {context} positions ({where}); use "
                f"{flag} {context} or less"
            )


def visible_gpus() -> int | None:
    """GPUs this process may use, without initialising CUDA (the actors must be the first to touch it): the
    entries of CUDA_VISIBLE_DEVICES (up to the first invalid one, as CUDA reads it), else the driver's list of
    GPUs. None when neither says (no NVIDIA driver here): nothing to check against."""
    driver = Path("/proc/driver/nvidia/gpus")
    installed = len(list(driver.iterdir())) if driver.is_dir() else None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return installed
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count if installed is None else min(count, installed)


def check_process_counts(cfg: Any) -> None:
    """Refuse trainer (and reference-model) process counts this machine cannot run. A CPU trainer needs a core per
    rank: the ranks meet in a collective every step, so a rank waiting for a core stalls all of them, and each rank
    is a process holding torch and its own shard (64 ranks on 2 cores exhaust the memory before the first step).
    Generator and reward processes are not counted: they wait while the trainer computes. On cuda, rank r takes
    GPU r unless --trainer.devices places the ranks, and every GPU index must be one this process can see."""
    trainer = getattr(cfg, "trainer", None)
    grpo = getattr(cfg, "grpo", None)
    meshes = [("--trainer.num-procs", trainer.num_procs)] if trainer is not None else []
    if grpo is not None and grpo.needs_reference:
        meshes.append(("--grpo.reference-procs", grpo.reference_procs))
    gpus = visible_gpus()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = "the driver's list" if visible is None else f"CUDA_VISIBLE_DEVICES={visible!r}"
    sees = f"this process sees {gpus} GPU{'s' if gpus != 1 else ''} ({where})"
    for flag, devices in (
        ("--trainer.devices", trainer.devices if trainer is not None else None),
        ("--generator.devices", getattr(getattr(cfg, "generator", None), "devices", None)),
    ):
        bad = [d for d in devices or () if gpus is not None and d >= gpus]
        if bad:
            raise ConfigError(f"{flag} {list(devices)} names GPU {bad[0]}, but {sees}; use indices below {gpus}")
    if trainer is None:
        return
    if trainer.device == "cpu":
        cores = len(os.sched_getaffinity(0))
        for flag, n in meshes:
            if n > cores:
                raise ConfigError(
                    f"{flag} {n} with --trainer.device cpu: this machine gives the run {cores} CPU core"
                    f"{'s' if cores != 1 else ''}, and a CPU trainer needs a core per rank (they meet in a collective "
                    f"every step; each rank is a process of its own); use {flag} {cores} or fewer"
                )
        return
    for flag, n in meshes:
        if gpus is not None and n > gpus and (flag != "--trainer.num-procs" or trainer.devices is None):
            hint = ", or place the ranks with --trainer.devices" if flag == "--trainer.num-procs" else ""
            raise ConfigError(
                f"{flag} {n} with --trainer.device cuda puts one rank on each GPU, but {sees}; use {flag} {gpus} or "
                f"fewer{hint}"
            )


def new_model_tokenizer(cfg: Any, task: Task | None) -> Any:
    """The tokenizer a new random model is made with: the reverse task's characters, or for any other task a
    byte-level BPE of `cfg.model.bpe_vocab_size` tokens trained on the task's own rows, with a ChatML template."""
    if task is None or task.name == "reverse":
        return cfg.reverse.tokenizer()
    from meshrl.tokenizer import train_bpe_tokenizer

    def text(prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else "\n".join(str(m.get("content", "")) for m in prompt)

    texts = [text(r.prompt) for r in task.train] + [r.answer for r in task.train if r.answer] + list(task.corpus)
    return train_bpe_tokenizer(texts, vocab_size=cfg.model.bpe_vocab_size)
