"""Token-in / token-out episodes: one token sequence per episode, grown turn by turn, never re-tokenized.

    ids = renderer.prompt_ids(opening)                  # turn 1's prompt: chat template + generation prompt
    ids += completion.token_ids                         # the model's tokens, as sampled (loss mask 1)
    more, images = episode_renderer.bridge(messages, obs, completion.token_ids)
    ids += more                                         # end of turn + observation + next generation prompt (loss
    ...                                                 # mask 0; an observation's images expanded as a prompt's),
                                                        # and the generator continues from ids

Re-rendering the whole conversation each turn (what several frameworks do) breaks multi-turn RL in two ways: the
model's text re-tokenizes to other ids than it sampled (`" 42"` vs `" 4" "2"`), and templates rewrite history
(Qwen3 drops earlier turns' reasoning; Llama 3 trims whitespace), so turn t+1's prompt is no longer turn t's prompt
plus the completion, and the trainer scores tokens the generator never produced. Here the sequence only grows: the
model's tokens are kept as sampled, and only the *new* text the template puts after the model's message is
tokenized, found by rendering the conversation with a sentinel in place of that message's content.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from meshrl.rollout.environment import EpisodeOutcome
from meshrl.rollout.render import Renderer
from meshrl.rollout.row import Row
from meshrl.types import Completion, Datum

# Stands in for the model's last message when finding what the template writes after it: text no template changes
# (no whitespace to trim, no '</think>' to split on) and no model writes.
SENTINEL = "<<meshrl:model-turn>>"


class EpisodeRenderer:
    """The model's chat template applied to episodes: opening prompts, and the ids between turns."""

    def __init__(self, renderer: Renderer) -> None:
        self.renderer = renderer
        self.tokenizer = renderer.tokenizer

    def opening(self, row: Row, opening: Sequence[dict] | None) -> tuple[list[dict[str, Any]], list[int]]:
        """(messages, prompt ids) of turn 1: the environment's opening messages, else the row's prompt (with the
        configured system prompt either way)."""
        start = self._opening_row(row, opening)
        return self.renderer.messages(start), self.renderer.prompt_ids(start)

    def opening_images(self, row: Row, opening: Sequence[dict] | None) -> tuple[bytes, ...]:
        """The encoded images of turn 1's prompt (`opening`'s), in the order of their image tokens."""
        return self.renderer.prompt_images(self._opening_row(row, opening))

    @staticmethod
    def _opening_row(row: Row, opening: Sequence[dict] | None) -> Row:
        return row if opening is None else Row(list(opening), row.answer, row.info)

    def bridge_ids(
        self, messages: Sequence[dict[str, Any]], observation: Sequence[dict[str, Any]], completion_ids: Sequence[int]
    ) -> list[int]:
        """`bridge`'s ids (for observations without images, or where only the ids matter)."""
        return self.bridge(messages, observation, completion_ids)[0]

    def bridge(
        self, messages: Sequence[dict[str, Any]], observation: Sequence[dict[str, Any]], completion_ids: Sequence[int]
    ) -> tuple[list[int], tuple[bytes, ...]]:
        """The ids that follow the model's last message (the last of `messages`, whose tokens `completion_ids`
        already are) up to the next generation prompt: the end of the model's turn (unless the model wrote it, as
        its stop token), the observation messages, and the header of the next assistant turn. With the
        observation's images (image parts, as in rows): their placeholders expanded to each image's tokens, and the
        encoded images, in that order, to append to the episode's."""
        images = self.observation_images(observation)
        if not self.renderer.use_chat_template:
            # Plain text: the observation on its own lines, then the model goes on.
            text = "\n" + "\n".join(str(m.get("content", "")) for m in observation) + "\n"
            return self.renderer.encode(text), ()
        history = [dict(m) for m in messages]
        history[-1] = {**history[-1], "content": SENTINEL}
        text = self._template(history + [dict(m) for m in observation])
        at = text.rfind(SENTINEL)
        if at < 0:
            raise ValueError(
                "the chat template dropped the model's last message when rendering the next turn; it cannot render "
                "multi-turn episodes"
            )
        after = text[at + len(SENTINEL) :]
        if completion_ids and completion_ids[-1] in self.renderer.stop_token_ids:
            # The model ended its turn with a stop token the template writes too (<|im_end|>, <|eot_id|>): it is
            # already in the sequence, as a model token.
            stop_text = self.tokenizer.decode([completion_ids[-1]])
            if stop_text and after.startswith(stop_text):
                after = after[len(stop_text) :]
        ids = self.renderer.encode(after)
        if images:
            # Only the observation's placeholders are in `after` (the earlier turns' are before the sentinel).
            ids = self.renderer.vision.expand(ids, images, what="the observation")
        return ids, images

    def observation_images(self, observation: Sequence[dict[str, Any]]) -> tuple[bytes, ...]:
        """The encoded images of an environment's observation messages, in the order the model sees them; () for
        text. Refused (ValueError, which ends the episode as the environment's error) for a model without a vision
        tower, a renderer without a chat template, or an image that does not decode."""
        from meshrl.rollout.images import image_parts, wire_image

        parts = image_parts(observation)
        if not parts:
            return ()
        if self.renderer.vision is None:
            raise ValueError(
                f"an observation has {len(parts)} image(s) but the model has no vision tower (its config.json has no "
                "vision_config); describe the observation in text, or train a vision-language checkpoint"
            )
        if not self.renderer.use_chat_template:
            raise ValueError("an observation with images needs the model's chat template (render.chat_template 'off')")
        return tuple(
            wire_image(p.get("image"), where=f"image {i} of the observation").data for i, p in enumerate(parts)
        )

    def _template(self, messages: list[dict[str, Any]]) -> str:
        cfg = self.renderer.cfg
        kw = {} if cfg.enable_thinking is None else {"enable_thinking": cfg.enable_thinking}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)

    def scripted_turn_ids(self, text: str) -> list[int]:
        """Ids of a demonstration message, as the model would write it: its text, then the end-of-turn stop token
        (the one the template ends assistant messages with, else EOS)."""
        return self.renderer.encode(text) + [self.end_of_turn_id]

    @property
    def end_of_turn_id(self) -> int:
        if not hasattr(self, "_end_of_turn_id"):
            self._end_of_turn_id = self.renderer.eos_id
            if self.renderer.use_chat_template:
                text = self._template([{"role": "user", "content": "x"}, {"role": "assistant", "content": SENTINEL}])
                after = self.renderer.encode(text[text.rfind(SENTINEL) + len(SENTINEL) :])
                first_stop = next((t for t in after if t in self.renderer.stop_token_ids), None)
                if first_stop is not None:
                    self._end_of_turn_id = first_stop
        return self._end_of_turn_id


@dataclass
class EpisodeTokens:
    """An episode's one sequence: every token, which ones the model sampled, and their sampling logprobs."""

    tokens: list[int] = field(default_factory=list)
    model_mask: list[int] = field(default_factory=list)  # per token: 1 = sampled by the model, 0 = prompt/env
    logprobs: list[float] = field(default_factory=list)  # per token: the sampling logprob (0 where not sampled)
    turn_starts: list[int] = field(default_factory=list)  # index of each model turn's first token
    policy_versions: set[int] = field(default_factory=set)
    images: tuple[bytes, ...] = ()  # encoded images, in the order of their image tokens (a vision-language model)

    def add_context(self, ids: Sequence[int]) -> None:
        self.tokens += ids
        self.model_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def add_completion(self, completion: Completion) -> None:
        if len(completion.prompt_ids) != len(self.tokens):
            raise RuntimeError(
                f"the generator continued a {len(completion.prompt_ids)}-token prompt, not this episode's "
                f"{len(self.tokens)} tokens"
            )
        self.turn_starts.append(len(self.tokens))
        self.tokens += completion.token_ids
        self.model_mask += [1] * len(completion.token_ids)
        self.logprobs += [float(x) for x in completion.logprobs]
        self.policy_versions.add(completion.policy_version)

    def add_scripted(self, ids: Sequence[int]) -> None:
        """A demonstration turn: trained on (mask 1), no sampling logprobs."""
        self.turn_starts.append(len(self.tokens))
        self.tokens += ids
        self.model_mask += [1] * len(ids)
        self.logprobs += [0.0] * len(ids)

    @property
    def num_model_tokens(self) -> int:
        return sum(self.model_mask)

    def datum(self, advantage: float = 0.0, *, with_logprobs: bool = True) -> Datum:
        """The training sequence: loss on the model's tokens only, their sampling logprobs as `old_logprobs`
        (Datum fields are aligned with the targets tokens[1:])."""
        import numpy as np

        tokens = np.asarray(self.tokens, dtype=np.int64)
        if len(tokens) < 2:
            raise ValueError("an episode needs at least 2 tokens to train on")
        mask = np.asarray(self.model_mask[1:], dtype=np.float64)
        old = np.asarray(self.logprobs[1:], dtype=np.float64) if with_logprobs else None
        return Datum(tokens, mask, old, advantage, images=self.images or None)


@dataclass
class Episode:
    """One finished episode: its tokens for the trainer, its outcome for the advantages and metrics."""

    tokens: EpisodeTokens
    outcome: EpisodeOutcome
    env_time_s: float = 0.0

    @property
    def answer_text(self) -> str:
        """The model's last message: what a rubric's reward functions score."""
        return next((m["content"] for m in reversed(self.outcome.messages) if m["role"] == "assistant"), "")

    def state(self) -> dict[str, Any]:
        """JSON-able (floats round-trip exactly); the row is not kept (the caller knows which row it was)."""
        t, o = self.tokens, self.outcome
        return {
            "tokens": [int(x) for x in t.tokens],
            "model_mask": [int(x) for x in t.model_mask],
            "logprobs": [float(x) for x in t.logprobs],
            "turn_starts": [int(x) for x in t.turn_starts],
            "policy_versions": sorted(int(v) for v in t.policy_versions),
            "messages": o.messages,
            "turn_rewards": [float(r) for r in o.turn_rewards],
            "reward": float(o.reward),
            "correct": bool(o.correct),
            "num_turns": o.num_turns,
            "finish_reason": o.finish_reason,
            "metrics": {k: float(v) for k, v in o.metrics.items()},
            "error": o.error,
            "reward_parts": {k: float(v) for k, v in o.reward_parts.items()},
            "reward_failures": dict(o.reward_failures),
            "env_time_s": self.env_time_s,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], row: Row) -> Episode:
        s = state
        tokens = EpisodeTokens(
            list(s["tokens"]), list(s["model_mask"]), list(s["logprobs"]), list(s["turn_starts"]),
            set(s["policy_versions"]),
        )  # fmt: skip
        outcome = EpisodeOutcome(
            row, list(s["messages"]), list(s["turn_rewards"]), s["reward"], s["correct"], s["num_turns"],
            s["finish_reason"], dict(s["metrics"]), s["error"], dict(s["reward_parts"]), dict(s["reward_failures"]),
        )  # fmt: skip
        return cls(tokens, outcome, s["env_time_s"])
