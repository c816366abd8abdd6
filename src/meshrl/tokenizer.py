"""A character-level tokenizer made in code and saved in HF format (tokenizer.json + config), so that
transformers' AutoTokenizer and vLLM load it like any other — no hub download at run time."""

from __future__ import annotations

from pathlib import Path

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]


class CharTokenizer:
    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError(f"tokenizer characters must be distinct, got {chars!r}")
        self.chars = chars
        self.vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(chars))}
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.pad_id, self.eos_id, self.bos_id, self.unk_id = range(4)

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        unknown = sorted({c for c in text if c not in self.vocab})
        if unknown:
            raise ValueError(f"characters {unknown} are not in the tokenizer's alphabet {self.chars!r}")
        return [self.vocab[c] for c in text]

    def decode(self, ids: list[int], *, stop_at_eos: bool = True) -> str:
        out = []
        for i in ids:
            if i == self.eos_id and stop_at_eos:
                break
            if i >= len(SPECIAL_TOKENS):
                out.append(self.id_to_token.get(i, ""))
        return "".join(out)

    def to_hf(self):
        """The same tokenizer as a transformers PreTrainedTokenizerFast."""
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab=self.vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
        )

    def save_pretrained(self, path: str | Path) -> None:
        self.to_hf().save_pretrained(str(path))
