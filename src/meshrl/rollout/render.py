"""Rendering: task rows -> prompt token ids, and completion token ids -> text, with the MODEL's tokenizer.

    renderer = Renderer.from_model_dir("ckpt/", RenderConfig(system_prompt="Think step by step."))
    ids = renderer.prompt_ids(Row("What is 2+3?", answer="5"))     # chat template, generation prompt
    text = renderer.completion_text(completion.token_ids)           # what the verifiers read

Done once, in the controller: the generators and trainers see token ids only (token-in / token-out), and a task
never tokenizes, so the same task trains any checkpoint with its own tokenizer, chat template and stop tokens.

Images (a vision-language checkpoint): a row's image parts ({"type": "image", "image": ...} in its messages) are
rendered by the chat template as one placeholder each, which `prompt_ids` repeats as many times as the image has
tokens (the model's image processor says how many: meshrl.models.vision); `prompt_images` gives the encoded images
that travel with the ids, in the same order. The pixels are made where the model runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from meshrl.errors import ConfigError
from meshrl.rollout.row import Row

if TYPE_CHECKING:
    from meshrl.models.vision import VisionInputs


@dataclass
class RenderConfig:
    """How prompts are turned into tokens (the model directory's tokenizer does it)."""

    chat_template: Literal["auto", "on", "off"] = "auto"
    """'auto': render through the tokenizer's chat template when it has one (plain-text prompts become one user
    turn), else feed the text as is; 'on': require a chat template; 'off': never use it (chat-message rows are then
    refused)."""
    system_prompt: str | None = None
    """A system message put before every chat prompt that has none of its own."""
    enable_thinking: bool | None = None
    """Passed to chat templates that switch reasoning on/off (Qwen3: False renders an empty <think></think>
    block). None: the template's own default."""

    def __post_init__(self) -> None:
        if self.chat_template not in ("auto", "on", "off"):
            raise ConfigError(f"render.chat_template={self.chat_template!r}; use auto, on or off")


class Renderer:
    """The model's tokenizer, applied the same way to every prompt of a run."""

    def __init__(
        self,
        tokenizer: Any,
        cfg: RenderConfig | None = None,
        *,
        stop_token_ids: Sequence[int] = (),
        vision: VisionInputs | None = None,
    ) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg or RenderConfig()
        self.vision = vision  # a vision-language model's image token counts (None: text only)
        has_template = getattr(tokenizer, "chat_template", None) is not None
        if self.cfg.chat_template == "on" and not has_template:
            raise ConfigError(
                "render.chat_template='on' but the model's tokenizer has no chat template; add one to the model "
                "directory (chat_template.jinja) or use --render.chat-template auto"
            )
        self.use_chat_template = has_template and self.cfg.chat_template != "off"
        eos = tokenizer.eos_token_id
        if eos is None and not stop_token_ids:
            raise ConfigError(
                "the model's tokenizer has no eos_token and the model config names no eos_token_id: generation "
                "would never stop; set eos_token in tokenizer_config.json"
            )
        self.eos_id: int = eos if eos is not None else stop_token_ids[0]
        self.stop_token_ids: list[int] = sorted({self.eos_id, *stop_token_ids})
        pad = tokenizer.pad_token_id
        self.pad_id: int = pad if pad is not None else self.eos_id

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, cfg: RenderConfig | None = None) -> Renderer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        from meshrl.models.hf_config import stop_token_ids
        from meshrl.models.vision import VisionInputs

        return cls(
            tokenizer, cfg, stop_token_ids=stop_token_ids(model_dir), vision=VisionInputs.from_model_dir(model_dir)
        )

    def messages(self, row: Row) -> list[dict[str, Any]]:
        """The row as chat messages, with the configured system prompt."""
        msgs = (
            [{"role": "user", "content": row.prompt}] if isinstance(row.prompt, str) else [dict(m) for m in row.prompt]
        )
        if self.cfg.system_prompt and not (msgs and msgs[0].get("role") == "system"):
            msgs.insert(0, {"role": "system", "content": self.cfg.system_prompt})
        return msgs

    def prompt_text(self, row: Row) -> str:
        if self.use_chat_template:
            kw = {} if self.cfg.enable_thinking is None else {"enable_thinking": self.cfg.enable_thinking}
            return self.tokenizer.apply_chat_template(
                self.messages(row), tokenize=False, add_generation_prompt=True, **kw
            )
        if not isinstance(row.prompt, str):
            raise ValueError(
                "a chat-message prompt needs a chat template, but the model's tokenizer has none (or "
                "render.chat_template='off'); give the rows as plain-text prompts or add a chat template"
            )
        if self.cfg.system_prompt:
            return f"{self.cfg.system_prompt}\n\n{row.prompt}"
        return row.prompt

    def encode(self, text: str) -> list[int]:
        # The chat template writes its own special tokens (BOS included where the model wants one).
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt_ids(self, row: Row) -> list[int]:
        ids = self.encode(self.prompt_text(row))
        if not ids:
            raise ValueError("the prompt renders to no tokens")
        images = self.prompt_images(row)
        if images:
            ids = self.vision.expand(ids, images)
        return ids

    def prompt_images(self, row: Row) -> tuple[bytes, ...]:
        """The row's images as encoded bytes, in the order the model sees them (empty for a text-only row). The
        same bytes objects every call (a resolved row holds them), so the samples of a group share them."""
        from meshrl.rollout.images import row_images, wire_image

        found = row_images(row)
        if not found:
            return ()
        if self.vision is None:
            raise ValueError(
                f"the row has {len(found)} image(s) but the model has no vision tower (its config.json has no "
                "vision_config); train a vision-language checkpoint, or give text-only rows"
            )
        if not self.use_chat_template:
            raise ValueError("a row with images needs the model's chat template (render.chat_template is 'off')")
        return tuple(wire_image(image, where="the row's image").data for image in found)

    def demonstration_ids(self, row: Row, response: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids ending in EOS): what a supervised warm-up trains on, shaped exactly like a
        completion the generator would sample for this prompt."""
        return self.prompt_ids(row), self.encode(response) + [self.eos_id]

    def completion_text(self, token_ids: Sequence[int]) -> str:
        """The text the verifiers read: the stop token that ended the completion removed, special tokens skipped."""
        ids = list(token_ids)
        if ids and ids[-1] in self.stop_token_ids:
            ids.pop()
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def completion_texts(self, token_ids: Sequence[Sequence[int]]) -> list[str]:
        return [self.completion_text(ids) for ids in token_ids]
