"""Tokenizers made in code and saved in HF format (tokenizer.json + tokenizer_config.json, chat template), so that
transformers' AutoTokenizer and vLLM load them like any other — no hub download at run time.

- `CharTokenizer`: one token per character of a fixed alphabet (the toy tasks' tokenizer).
- `train_bpe_tokenizer`: a byte-level BPE (GPT-2 / Qwen style: any text encodes, nothing is unknown) trained on
  given texts, with ChatML turn markers and a chat template — what a real chat model ships, in miniature.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

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
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tok = Tokenizer(models.WordLevel(vocab=self.vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
        # Without a decoder, transformers joins word-level tokens with spaces ('c b a'); the controller decodes
        # completions with the model directory's tokenizer, so it must give back the characters as they are.
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>"
        )

    def save_pretrained(self, path: str | Path) -> None:
        self.to_hf().save_pretrained(str(path))


def unknown_characters(tokenizer, text: str, ids: Sequence[int] | None = None) -> list[str]:
    """The characters of `text` that a transformers `tokenizer` encodes as its unknown token — text a model would
    train on as `<unk>`, silently — sorted; [] when it has no unknown token or none occurs. The unknown token's own
    string written in the text is not unknown. `ids`: the text's ids, when already encoded (without special tokens)."""
    unk_id, unk = getattr(tokenizer, "unk_token_id", None), getattr(tokenizer, "unk_token", None)
    if unk_id is None:
        return []
    if ids is None:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if unk_id not in ids:
        return []
    if getattr(tokenizer, "is_fast", False):  # offsets say which span of the text each unknown id came from
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        spans = [text[a:b] for i, (a, b) in zip(enc["input_ids"], enc["offset_mapping"], strict=True) if i == unk_id]
        spans = [span for span in spans if span and span != unk]
    else:
        spans = [text.replace(unk, "")] if unk else [text]
    found: set[str] = set()
    for span in spans:
        # A span may be a whole word of which one character is unknown: keep the characters that are so alone.
        alone = {c for c in set(span) if unk_id in tokenizer(c, add_special_tokens=False)["input_ids"]}
        found |= alone or ({span} if getattr(tokenizer, "is_fast", False) else set())
    return sorted(found)


# ---------------------------------------------------------------------------------------------------------------
# byte-level BPE with a ChatML chat template

PAD_TOKEN = "<|pad|>"
ENDOFTEXT_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_TOKENS = ("<think>", "</think>")
# Special tokens in id order: the pad id is 0 (meshrl's default `pad_id`), then the document end and the turn markers.
BPE_SPECIAL_TOKENS = (PAD_TOKEN, ENDOFTEXT_TOKEN, IM_START, IM_END)

# ChatML as Qwen2/Qwen3 render it: `<|im_start|>{role}\n{content}<|im_end|>\n` per message (a system message is
# simply the first one, when given), then `<|im_start|>assistant\n` with add_generation_prompt. With
# `enable_thinking=False` (Qwen3's switch) the generation prompt also holds an empty think block, so the model
# answers directly. The template adds no bos token (none is prepended: Qwen's convention).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    chat_template: str | None = CHATML_TEMPLATE,
    min_frequency: int = 2,
    individual_digits: bool = True,
    think_tokens: bool = True,
    extra_special_tokens: Sequence[str] = (),
    model_max_length: int | None = None,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` with the `tokenizers` library, as a transformers
    `PreTrainedTokenizerFast` (save it with `save_pretrained`). Deterministic: the same texts give the same vocabulary
    and merges.

    Vocabulary (at most `vocab_size` ids; fewer when the texts have fewer merges to learn): ids 0-3 are the special
    tokens `<|pad|>`, `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (never split, and dropped by
    `decode(skip_special_tokens=True)`), then the 256 byte symbols (any UTF-8 text encodes; there is no unknown
    token), then the learnt merges, then — with `think_tokens` — `<think>` and `</think>` as ordinary (not special)
    added tokens, single ids as in Qwen3, so reasoning stays visible when decoding. `individual_digits`: every digit is
    its own token (as Qwen and Llama 3 split numbers), which makes arithmetic learnable by a small model.

    Special roles, chosen so that the three never collide:
    - `eos_token`: `<|im_end|>` when `chat_template` is given (ChatML: a model's turn ends there, so generation stops
      at the end of its answer), else `<|endoftext|>` (plain text: a document ends there).
    - `pad_token`: `<|pad|>`, id 0, never eos: padding is not a stop signal, and collators that mask pad ids out of
      the labels (HF's `DataCollatorForLanguageModeling`) would otherwise never teach the model to stop.
    - `bos_token`: `<|endoftext|>` (GPT-2's convention), so configs get a valid bos id; it is never added
      automatically (no post-processor adds it, and the chat template does not either).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(BPE_SPECIAL_TOKENS) + [t for t in extra_special_tokens if t not in BPE_SPECIAL_TOKENS]
    added = list(THINK_TOKENS) if think_tokens else []
    n_alphabet = len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(specials) + n_alphabet + len(added):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: a byte-level BPE needs {n_alphabet} byte symbols + "
            f"{len(specials)} special tokens{f' + {len(added)} think tokens' if added else ''} "
            f"= {len(specials) + n_alphabet + len(added)} ids before any merge"
        )
    tok = Tokenizer(models.BPE())
    pieces = [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")] if individual_digits else []
    # GPT-2's split regex (words, numbers, punctuation, spaces kept with the next word), then bytes -> symbols.
    tok.pre_tokenizer = pre_tokenizers.Sequence(pieces + [pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(added),
        min_frequency=min_frequency,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # A list, not a generator: the trainer then sees the texts in one fixed order.
    tok.train_from_iterator(list(texts), trainer=trainer)
    if added:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    kwargs = {} if model_max_length is None else {"model_max_length": int(model_max_length)}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END if chat_template is not None else ENDOFTEXT_TOKEN,
        bos_token=ENDOFTEXT_TOKEN,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


# A small built-in corpus (English, digits, arithmetic and symbols) for toy tokenizers when no texts are given.
_WORDS = (
    "the a an of to and in is it that for on with as was be by this are or from at which but not have has had "
    "one two three four five six seven eight nine ten answer question what how many sum product difference total "
    "number numbers add plus minus times divided equals result step first then next finally so therefore think "
    "reverse the string letters word words sentence count each every value compute solve problem user assistant "
    "system you are a helpful model please give your final short correct yes no true false because if else "
    "apples oranges books cars train hours minutes left right more less than most least half twice"
).split()
_SYMBOLS = "+ - * / = < > ( ) [ ] { } . , ; : ! ? % ^ # $ & _ ' \" \\ | ~ @ `".split()


def default_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """`n` short texts mixing English words, numbers, arithmetic, symbols and ChatML-shaped exchanges; the same
    list for the same arguments (a seeded generator, no downloads)."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + ".")
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            value = {"+": a + b, "-": a - b, "*": a * b}[op]
            out.append(f"What is {a} {op} {b}? {a} {op} {b} = {value}. The answer is {value}.")
        elif kind == 2:
            out.append(" ".join(rng.choice(_SYMBOLS + _WORDS[:20]) for _ in range(rng.randint(3, 12))))
        else:
            w = rng.choice(_WORDS)
            out.append(f"{IM_START}user\nReverse the word {w}.{IM_END}\n{IM_START}assistant\n{w[::-1]}{IM_END}\n")
    return out
