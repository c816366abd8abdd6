"""Make a tiny random HF checkpoint (Qwen3, Qwen2, Llama or GPT-2) with a byte-level BPE tokenizer and a ChatML
chat template, all trained / built here (no downloads), for trying meshrl's CLI on a local model directory:

    python scripts/make_tiny_checkpoint.py --arch llama --out ckpt/llama-tiny
    python -m meshrl.controller.grpo --model.path ckpt/llama-tiny --model.backend hf ...

`--arch qwen2_5_vl` / `--arch qwen3_vl` make a vision-language checkpoint instead (meshrl.models.tiny_vlm): the
family's chat template and processor files beside the model and tokenizer (`--dropout` and `--no-chat-template`
do not apply to them).

`--texts FILE.jsonl` trains the tokenizer on your own texts (one JSON object per line with a "text" field, or
"prompt"/"completion"/"messages" fields, or one JSON string per line); without it, a built-in corpus of English
words, numbers, arithmetic and symbols.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_texts(path: Path) -> list[str]:
    texts = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{n}: not JSON ({e})") from None
            if isinstance(row, str):
                texts.append(row)
                continue
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{n}: expected a JSON object or string, got {type(row).__name__}")
            found = [str(row[k]) for k in ("text", "prompt", "completion", "question", "answer") if row.get(k)]
            for m in row.get("messages") or []:
                if isinstance(m, dict) and m.get("content"):
                    found.append(str(m["content"]))
            if not found:
                raise SystemExit(f"{path}:{n}: no 'text', 'prompt', 'completion' or 'messages' field")
            texts.extend(found)
    if not texts:
        raise SystemExit(f"{path} holds no texts")
    return texts


def main(argv: list[str] | None = None) -> Path:
    from meshrl.models.tiny_hf import ARCHS
    from meshrl.models.tiny_vlm import VLM_ARCHS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--arch", choices=ARCHS + VLM_ARCHS, default="qwen3", help="model architecture (default: qwen3)")
    p.add_argument("--out", type=Path, required=True, help="output directory (replaced if it exists)")
    p.add_argument("--vocab-size", type=int, default=512, help="BPE vocabulary size, >= 262 (default: 512)")
    p.add_argument("--texts", type=Path, default=None, help="JSONL file of texts to train the tokenizer on")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument(
        "--num-heads", type=int, default=2, help="attention heads (head size = hidden / heads; >= 32 for vLLM on CPU)"
    )
    p.add_argument("--num-kv-heads", type=int, default=1, help="key/value heads (grouped-query attention; not GPT-2)")
    p.add_argument("--max-position-embeddings", type=int, default=256, help="context length (default: 256)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probabilities in the config (default: 0)")
    p.add_argument("--no-chat-template", action="store_true", help="plain-text tokenizer (eos <|endoftext|>)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    vision = args.arch in VLM_ARCHS
    if vision and (args.no_chat_template or args.dropout):
        p.error(f"--no-chat-template and --dropout do not apply to --arch {args.arch}")
    common = dict(
        vocab_size=args.vocab_size,
        texts=read_texts(args.texts) if args.texts else None,
        seed=args.seed,
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings,
    )
    try:
        if vision:
            from meshrl.models.tiny_vlm import create_tiny_vlm

            out = create_tiny_vlm(args.out, args.arch, **common)
        else:
            from meshrl.models.tiny_hf import create_tiny_chat_model
            from meshrl.tokenizer import CHATML_TEMPLATE

            template = None if args.no_chat_template else CHATML_TEMPLATE
            out = create_tiny_chat_model(
                args.out, arch=args.arch, chat_template=template, dropout=args.dropout, **common
            )
    except ValueError as e:  # e.g. a vocabulary too small for the byte alphabet, heads that do not divide
        raise SystemExit(f"error: {e}") from None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    kind = f"{args.arch} vision-language" if vision else args.arch
    print(f"wrote a tiny {kind} checkpoint ({len(tok)} tokens, eos {tok.eos_token!r}) to {out}")
    return out


if __name__ == "__main__":
    main()
