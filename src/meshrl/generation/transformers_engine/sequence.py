"""One sampled completion in the making: its prompt, its sampling settings and seed, what it has sampled so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from meshrl.types import SamplingParams


@dataclass
class Sequence:
    prompt_index: int
    """Which prompt of the `generate` call (a prompt's n samples share it, and the prompt list object)."""
    prompt: list[int]
    seed: int
    """Seed of the counter-based sampling noise (`sampler.uniform_noise`): with `step = len(tokens)`."""
    params: SamplingParams
    stop: frozenset[int]
    """Token ids that end the sequence (kept, with their logprob): the request's and the model's eos ids."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    """None while running; 'stop' or 'length' once finished."""
    images: tuple[bytes, ...] = ()
    """The prompt's encoded images (a vision-language model), in the order of its image-token runs."""

    @property
    def uses_host_sampling(self) -> bool:
        """top-k / top-p: sampled outside the device loop, one host round trip per step."""
        return self.params.temperature != 0 and (self.params.top_k != -1 or self.params.top_p < 1)

    def append(self, tokens: list[int], logprobs: list[float], may_stop: bool = True) -> None:
        """Append tokens sampled in a row; the sequence ends at the first stop token (what follows it is dropped:
        the device loop kept decoding past it) or at max_tokens. `may_stop=False`: none of `tokens` is a stop
        token (the caller checked the whole batch at once)."""
        cut = next((k + 1 for k, t in enumerate(tokens) if t in self.stop), 0) if may_stop else 0
        if cut:
            self.tokens += tokens[:cut]
            self.logprobs += logprobs[:cut]
            self.finish_reason = "stop"
        else:
            self.tokens += tokens
            self.logprobs += logprobs
            if len(self.tokens) >= self.params.max_tokens:
                self.finish_reason = "length"


__all__ = ["Sequence"]
