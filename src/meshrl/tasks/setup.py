"""A task made ready for a run: the model it trains, its splits rendered once with the model's tokenizer, and the
reward functions that judge it — everything checked before any actor process starts.

    task = build_task(cfg, train_rows=rows)
    model_dir = ensure_model(cfg, task, run_dir)
    setup = TaskSetup.prepare(cfg, task, model_dir)
    setup.train.prompt_ids[i], setup.train.views[i]        # what the generators and verifiers get
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshrl.errors import ConfigError
from meshrl.preflight import check_model_dir
from meshrl.rollout.render import Renderer
from meshrl.tasks.base import Row, Task

if TYPE_CHECKING:
    from meshrl.config import GRPORunConfig, SFTRunConfig


@dataclass(frozen=True)
class PromptBudget:
    """How a split's prompt budget is made — the sequence limit less the tokens kept for the answer, under the model's
    context — so that a message about prompts over it says what can change, and when raising the limit cannot help.

        PromptBudget.of(cfg, model_dir, limit=cfg.generator.max_model_len, response=cfg.generator.max_tokens)
    """

    limit: int
    """The longest sequence: --generator.max-model-len (with an environment, --env.max-tokens when set)."""
    response: int
    """Tokens kept for the model's answer: --generator.max-tokens (--eval.max-tokens for held-out prompts)."""
    limit_flag: str = "--generator.max-model-len"
    response_flag: str = "--generator.max-tokens"
    context: tuple[int, str] | None = None
    """(the model's context in positions, where it is written: meshrl.preflight.model_dir_context); None: unknown."""

    @property
    def tokens(self) -> int:
        return self.limit - self.response

    @classmethod
    def of(cls, cfg: Any, model_dir: str | Path, *, limit: int, response: int, held_out: bool = False) -> PromptBudget:
        """The budget of a run config's train (or `held_out`) prompts, the flags named as the config sets them."""
        from meshrl.preflight import model_dir_context

        env, eval_cfg = getattr(cfg, "env", None), getattr(cfg, "eval", None)
        by_env = env is not None and env.name is not None and env.max_tokens is not None
        by_eval = held_out and eval_cfg is not None and eval_cfg.max_tokens is not None
        return cls(
            limit,
            response,
            "--env.max-tokens" if by_env else "--generator.max-model-len",
            "--eval.max-tokens" if by_eval else "--generator.max-tokens",
            model_dir_context(model_dir),
        )

    def made(self) -> str:
        return f"{self.limit_flag} {self.limit} - {self.response_flag} {self.response}"

    def to_fit(self, length: int) -> str:
        """What makes a prompt of `length` tokens fit: raising the limit while the model's context allows it; past
        that, a smaller answer budget, a model with a longer context, or shorter prompts."""
        need = length + self.response
        if self.context is None:
            return (
                f"raise {self.limit_flag} to at least {need} (config.json gives no context length: make sure the "
                f"model was trained that long), or lower {self.response_flag}"
            )
        context, where = self.context
        if need <= context:
            return (
                f"raise {self.limit_flag} to at least {need} (the model's context is {context} positions, {where}), "
                f"or lower {self.response_flag}"
            )
        full = self.limit >= context
        if full:
            why = f"{self.limit_flag} {self.limit} already uses all of it, so raising {self.limit_flag} cannot help"
        else:
            why = (
                f"{self.limit_flag} can rise to {context}, leaving {context - self.response} prompt tokens, so "
                f"raising {self.limit_flag} alone cannot help"
            )
        why = f"the model's context is {context} positions ({where}) and {why}"
        also = "" if full else f" (with {self.limit_flag} {context})"
        ways = [f"lower {self.response_flag} to {context - length} or less{also}"] if length < context else []
        ways += ["use a model with a longer context", "use shorter prompts"]
        return f"{why}: {', '.join(ways[:-1])} or {ways[-1]}"


@dataclass
class PromptSet:
    """One split of a task, rendered once: prompt ids and verifier views per row. Prompts over the token budget
    are dropped and counted (never truncated: a cut prompt asks a different question)."""

    rows: list[Row]
    prompt_ids: list[list[int]]
    views: list[dict[str, Any]]
    dropped: int = 0
    budget: int = 0
    shortest: int = 0  # prompt lengths in tokens, over every row rendered (the dropped included)
    longest: int = 0
    made: PromptBudget | None = None  # how `budget` is made, when known
    skipped: int = 0  # prompts with characters outside the tokenizer's vocabulary (on_bad_row="skip")
    untokenised: int = 0  # of the dropped, those over `char_cap` characters: dropped before tokenising
    char_cap: int = 0  # characters past which a prompt cannot fit the budget (meshrl.data.lengths)
    images: list[tuple[bytes, ...]] = field(default_factory=list)  # per row: its encoded images (() for none)

    def images_of(self, picks: Sequence[int]) -> list[tuple[bytes, ...]] | None:
        """The images of the rows `picks`, None when none has any (a text-only call)."""
        out = [self.images[i] for i in picks] if self.images else []
        return out if any(out) else None

    @classmethod
    def render(
        cls, rows: Sequence[Row], renderer: Renderer, budget: int | PromptBudget, what: str, on_bad_row: str = "error"
    ) -> PromptSet:
        """`on_bad_row`: a prompt with characters the tokenizer reads as its unknown token (the model would see
        `<unk>` for them) stops the run naming it ("error"), or is skipped and counted ("skip"), as SFT rows are. A
        prompt of more characters than the budget can hold is dropped before tokenising (a 50 MB row takes minutes)."""
        from meshrl.data.lengths import char_cap, text_chars

        made = budget if isinstance(budget, PromptBudget) else None
        budget = made.tokens if made is not None else budget
        kept, ids, dropped, lengths, skipped, untokenised = [], [], 0, [], 0, 0
        images: list[tuple[bytes, ...]] = []
        unk_id = getattr(renderer.tokenizer, "unk_token_id", None)
        cap = char_cap(renderer.tokenizer, budget)
        for i, row in enumerate(rows):
            if text_chars(row.prompt) > cap:
                dropped, untokenised = dropped + 1, untokenised + 1
                continue
            try:
                prompt = renderer.prompt_ids(row)
            except Exception as e:  # noqa: BLE001 - a template that cannot render a row: name the row
                raise ValueError(f"{what} row {i + 1}: cannot render its prompt: {e}") from e
            if (
                unk_id is not None
                and unk_id in prompt
                and _unknown(renderer, row, prompt, f"{what} prompt {i + 1}", on_bad_row)
            ):
                skipped += 1
                continue
            lengths.append(len(prompt))
            if len(prompt) > budget:
                dropped += 1
                continue
            kept.append(row)
            ids.append(prompt)
            images.append(renderer.prompt_images(row))
        shortest, longest = (min(lengths), max(lengths)) if lengths else (0, 0)
        split = cls(kept, ids, [r.verifier_view() for r in kept], dropped, budget, shortest, longest, made, skipped)
        split.untokenised, split.char_cap, split.images = untokenised, cap, images
        if not kept and not dropped:
            raise ConfigError(
                f"every one of the {len(rows)} {what} prompts has characters outside the tokenizer's vocabulary: is "
                "the data in a language or script this model's tokenizer does not cover?"
            )
        if not kept:
            advice = f"To fit the shortest, {_to_fit(made, shortest, budget)}" if lengths else "Use shorter prompts"
            raise ConfigError(
                f"every one of the {dropped} {what} prompts is longer than the {budget}-token prompt budget"
                f"{f' ({made.made()})' if made else ''}: {split.lengths()}. {advice}"
            )
        return split

    def __len__(self) -> int:
        return len(self.rows)

    def describe(self, what: str) -> str:
        note = f", {self.dropped} dropped (prompt over {self.budget} tokens)" if self.dropped else ""
        if self.skipped:
            note += f", {self.skipped} skipped (characters outside the tokenizer's vocabulary)"
        return f"{what}: {len(self)} prompts{note}"

    def dropped_warning(self, what: str) -> str | None:
        """A warning when 10 % or more of the split was dropped (a silent loss of this size would change what the
        run trains on), with the lengths, how the budget is made and what keeps them; None otherwise."""
        total = len(self) + self.dropped
        if self.dropped < 0.1 * total:
            return None
        made = f" ({self.made.made()})" if self.made else ""
        if self.longest > self.budget:
            advice = f"To keep them all, {_to_fit(self.made, self.longest, self.budget)}"
        else:  # only prompts too long to tokenise were dropped
            advice = f"Shorten the prompts over {self.char_cap} characters, or leave them out"
        return (
            f"{self.dropped} of {total} {what} prompts ({self.dropped / total:.0%}) are longer than the "
            f"{self.budget}-token prompt budget{made} and were dropped: {self.lengths()}. {advice}"
        )

    def lengths(self) -> str:
        """The lengths of the prompts rendered: in tokens, and how many were too long to tokenise."""
        told = [f"prompts are {self.shortest} to {self.longest} tokens"] if self.longest else []
        if self.untokenised:
            told.append(
                f"{self.untokenised} over {self.char_cap} characters (more than {self.budget} tokens can hold; not "
                "tokenised)"
            )
        return ", and ".join(told)


def _unknown(renderer: Renderer, row: Row, prompt: list[int], name: str, on_bad_row: str) -> bool:
    """Whether the prompt has characters outside the tokenizer's vocabulary (then: BadRowError, or True to skip it).
    Called only when the unknown token's id is among the prompt's ids (the unknown token's own text written in a
    prompt is not unknown)."""
    from meshrl.data.prompts import SKIP_HINT
    from meshrl.data.rows import BadRowError
    from meshrl.tokenizer import unknown_characters

    unknown = unknown_characters(renderer.tokenizer, renderer.prompt_text(row), prompt)
    if not unknown or on_bad_row == "skip":
        return bool(unknown)
    text = row.prompt if isinstance(row.prompt, str) else str(row.prompt[-1].get("content", ""))
    preview = repr(text[:40]) + ("..." if len(text) > 40 else "")
    shown = unknown[:10] + (["..."] if len(unknown) > 10 else [])
    raise BadRowError(
        f"{name} ({preview}): characters {shown} are not in the tokenizer's vocabulary (they would be read as "
        f"{renderer.tokenizer.unk_token!r}); remove or replace them, or use a model whose tokenizer covers them "
        f"({SKIP_HINT})"
    )


def _to_fit(made: PromptBudget | None, length: int, budget: int) -> str:
    if made is not None:
        return made.to_fit(length)
    return f"raise --generator.max-model-len by {length - budget} or more, or lower --generator.max-tokens as much"


def reward_weights(
    spec: str, task: Task, reward_fns: Mapping[str, Callable] | None = None
) -> tuple[dict[str, float], dict[str, Callable]]:
    """(name -> weight, name -> callable) from a reward spec, 'task' meaning the task's own verifier. Functions
    given from Python (`reward_fns`) join with weight 1.0 unless the spec weighs them."""
    from meshrl.rewards import parse_reward_spec

    weights: dict[str, float] = {}
    for name, w in (parse_reward_spec(spec) if spec else {}).items():  # "": functions from Python only
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
    rewards: Any  # meshrl.rewards.Rubric
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
        """`cfg`: a run config with model, generator, render, scoring, reward and (optionally) eval and env
        sections. The model directory and its trainer backend are checked before this, first thing
        (`meshrl.preflight`).

        Single-turn (no `cfg.env.name`): the rubric is `--reward` (else the task's default rewards; functions given
        from Python replace those), the verifier is `--eval.verifier` or the task's. With an environment: it scores
        its episodes and gives their verdict (verifier 'env'); `--reward` / `reward_fns` add a rubric whose score of
        each episode's last answer adds to the environment's reward. Prompts leave room for one model turn: within
        generator.max_model_len, or the episode's token limit (`--env.max-tokens`)."""
        from meshrl.rewards import Rubric

        # The tokenizer was checked against the model first thing (preflight.check_run_inputs), or the run made both.
        renderer = Renderer.from_model_dir(model_dir, cfg.render)
        gen = cfg.generator
        env = getattr(cfg, "env", None)  # SFT runs have no environment section
        given = getattr(cfg, "reward", None)  # SFT runs evaluate with the task's own rewards
        if env is not None and env.name is not None:
            rewards = None
            if given or reward_fns:
                weights, fns = reward_weights(given or "", task, reward_fns)
                rewards = Rubric(weights, cfg.scoring, fns=fns)
            verifier, budget = "env", env.max_tokens or gen.max_model_len
        else:
            spec = given or task.reward
            if given is None and reward_fns:
                spec = ""  # functions given from Python replace the task's default rewards
            weights, fns = reward_weights(spec, task, reward_fns)
            eval_cfg = getattr(cfg, "eval", None)
            verifier = (eval_cfg.verifier if eval_cfg is not None else None) or task.verifier or next(iter(weights))
            if verifier == "task":
                verifier = task.verifier
            weights.setdefault(verifier, 0.0)  # measured on every sample (accuracy), weighs nothing unless named
            rewards = Rubric(weights, cfg.scoring, fns=fns)
            budget = gen.max_model_len
            _say_the_verifier(task, verifier, given)
        return cls.build(
            task,
            renderer,
            rewards,
            verifier,
            train_budget=PromptBudget.of(cfg, model_dir, limit=budget, response=gen.max_tokens),
            eval_budget=PromptBudget.of(
                cfg, model_dir, limit=budget, response=eval_max_tokens or gen.max_tokens, held_out=True
            ),
            on_bad_row=getattr(getattr(cfg, "data", None), "on_bad_row", "error"),  # prompts with <unk> characters
        )

    @classmethod
    def build(
        cls,
        task: Task,
        renderer: Renderer,
        rewards: Any,
        verifier: str,
        *,
        train_budget: int | PromptBudget,
        eval_budget: int | PromptBudget,
        on_bad_row: str = "error",
    ) -> TaskSetup:
        """From parts made by hand (`prepare` makes them from a run config): renders both splits."""
        train = PromptSet.render(task.train, renderer, train_budget, "train", on_bad_row)
        held_out = PromptSet.render(task.eval, renderer, eval_budget, "eval", on_bad_row)
        for split, what in ((train, "train"), (held_out, "eval")):
            if warning := split.dropped_warning(what):
                print(f"[meshrl] WARNING: {warning}", file=sys.stderr, flush=True)
        notes = [train.describe("train"), held_out.describe("eval")]
        notes += [f"skipped bad rows, {reason}: {n}" for reason, n in task.skipped.items()]
        return cls(task, renderer, train, held_out, rewards, verifier, notes)

    def describe_rewards(self) -> str:
        if self.rewards is None:
            return "the environment's"
        if self.verifier == "env":
            return "the environment's + " + ", ".join(f"{n}={w:g}" for n, w in self.rewards.weights.items())
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


def ensure_model(cfg: GRPORunConfig | SFTRunConfig, task: Task | None, run_path: Path) -> str:
    """The checkpoint a run starts from: `cfg.model.path`, or a new random model of `cfg.model.flavor` written into
    the run directory with `new_model_tokenizer` (a resumed run finds it there already)."""
    model_cfg = cfg.model
    if model_cfg.path is not None:
        check_model_dir(model_cfg.path)
        return str(model_cfg.path)
    model_dir = run_path / "base_model"
    if not (model_dir / "config.json").exists():
        from meshrl.models.config import VLM_FLAVORS

        if model_cfg.flavor in VLM_FLAVORS:  # a tiny vision-language model, its BPE trained on the task's texts
            from meshrl.models.tiny_vlm import create_tiny_vlm

            texts = task_texts(task) if task is not None else None
            # Weights drawn at std 0.1, not transformers' 0.02: at 0.02 the tiny vision tower's features are too
            # faint for the language model to pick up (measured on --task shapes: the SFT loss stayed at the
            # answer prior, ~0.6 nats a token, for 1000 steps; at 0.1 it fell to 0.17 in 400).
            create_tiny_vlm(model_dir, VLM_FLAVORS[model_cfg.flavor], vocab_size=model_cfg.bpe_vocab_size,
                            seed=model_cfg.seed, texts=texts, initializer_range=0.1)  # fmt: skip
            return str(model_dir)
        from meshrl.models.qwen3 import create_random_checkpoint

        tokenizer = new_model_tokenizer(cfg, task)
        create_random_checkpoint(model_dir, flavor=model_cfg.flavor, tokenizer=tokenizer, seed=model_cfg.seed)
    return str(model_dir)


def task_texts(task: Task) -> list[str]:
    """The texts a new model's tokenizer learns from: the training prompts' text (the text parts of chat messages),
    the answers and the task's own corpus."""

    def text(content: Any) -> str:
        if isinstance(content, str):
            return content
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"]
        return "\n".join(parts)

    def prompt_text(prompt: Any) -> str:
        return prompt if isinstance(prompt, str) else "\n".join(text(m.get("content", "")) for m in prompt)

    return [prompt_text(r.prompt) for r in task.train] + [r.answer for r in task.train if r.answer] + list(task.corpus)


def new_model_tokenizer(cfg: GRPORunConfig | SFTRunConfig, task: Task | None) -> Any:
    """The tokenizer a new random model is made with: the reverse task's characters, or for any other task a
    byte-level BPE of `cfg.model.bpe_vocab_size` tokens trained on the task's own rows, with a ChatML template."""
    if task is None or task.name == "reverse":
        return cfg.reverse.tokenizer()
    from meshrl.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(task_texts(task), vocab_size=cfg.model.bpe_vocab_size)


def _say_the_verifier(task: Task, verifier: str, given: str | None) -> None:
    """Which verifier judges correctness, said at launch; and a warning when it is math-verify and no held-out
    answer reads as math (letter or word answers: every completion would score 0, silently)."""
    default = "" if given else " (the task's default; --reward / --eval.verifier choose another)"
    print(f"[meshrl] verifier: {verifier}{default}", flush=True)
    if verifier != "math_verify":
        return
    from meshrl.rewards import math_parseable

    answers = [row.answer for row in list(task.eval)[:200]]
    if answers and not math_parseable(answers, stop_at=1):
        examples = ", ".join(repr(a) for a in answers[:3])
        print(
            f"[meshrl] WARNING: none of the {len(answers)} held-out answers checked (e.g. {examples}) reads as math, "
            "so math_verify will score every completion 0; use --reward exact (exact string match), exact_match, "
            "regex, or your own function (--reward my_pkg.my_mod:fn)",
            file=sys.stderr,
            flush=True,
        )
