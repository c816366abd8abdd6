"""Shared pieces of the GPU benchmarks: the Qwen3-0.6B-shaped random model, copy bandwidth, output.

Each benchmark script is one command, prints its table last and writes JSON under $OUT (else bench/results/).
`--tiny` runs every code path on a small model (CPU smoke test of the script, not a result).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

# Qwen3-0.6B (transformers' Qwen3Config fields; torchtitan's "0.6B" flavor): 596 M parameters, tied embeddings.
QWEN3_06B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
TINY = dict(QWEN3_06B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)  # fmt: skip


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def make_model_dir(path: str | Path, *, tiny: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> str:
    """A random-weight Qwen3 (HF format, no tokenizer) with no EOS, so every sample runs to max_tokens."""
    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        **(TINY if tiny else QWEN3_06B),
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        architectures=["Qwen3ForCausalLM"],
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    with device():  # initialise on the GPU: seconds instead of a minute of CPU init for 0.6B
        model = Qwen3ForCausalLM(cfg).to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return str(path)


def copy_bandwidth(dev: torch.device, nbytes: int = 1 << 30, iters: int = 20) -> float:
    """Device-memory bandwidth in bytes/s, counting bytes read + written by a large copy (GPU.md's convention)."""
    if dev.type != "cuda":
        nbytes, iters = 1 << 26, 3
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    sync(dev)
    dt = (time.perf_counter() - t0) / iters
    del a, b
    return 2 * nbytes / dt


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def peak_gib(dev: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None


def reset_peak(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def environment() -> dict[str, Any]:
    import transformers

    dev = device()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def write_json(name: str, payload: dict[str, Any]) -> Path:
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def print_table(title: str, headers: list[str], rows: list[list[Any]]) -> None:
    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:,.3g}" if abs(v) < 100 else f"{v:,.0f}"
        return str(v)

    cells = [headers] + [[fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print(f"\n{title}")
    for i, r in enumerate(cells):
        print("  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))


ROOT = Path(__file__).resolve().parent.parent


def ensure_meshrl_layout() -> None:
    """`meshrl.actors` / `.controller` / `.configs` live in top-level folders (pyproject's package-dir). Without an
    installed package (the GPU machine), assemble the namespace in a temp dir and put it on sys.path and on
    PYTHONPATH (Monarch's spawned processes inherit it)."""
    try:
        import meshrl.actors  # noqa: F401
        import meshrl.controller  # noqa: F401

        return
    except ImportError:
        pass
    import shutil

    tree = Path(tempfile.mkdtemp(prefix="meshrl-tree-"))
    shutil.copytree(ROOT / "src" / "meshrl", tree / "meshrl")
    for sub, name in (("actors", "actors"), ("controller", "controller"), ("configs", "configs")):
        shutil.copytree(ROOT / sub, tree / "meshrl" / name)
    for mod in [m for m in sys.modules if m == "meshrl" or m.startswith("meshrl.")]:
        del sys.modules[mod]
    sys.path.insert(0, str(tree))
    os.environ["PYTHONPATH"] = f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
