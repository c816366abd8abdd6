"""The vision-language GPU check (issue 34): the GRPO program (`python -m meshrl.controller.grpo`) on a
Qwen2.5-VL-shaped model whose vision tower is the released one's size (32 blocks of 1280, 16 heads, windows of 4x4
image tokens, full attention every 8th block: ~0.67 B parameters) under a 0.5 B-shaped language model (Qwen2.5-0.5B:
24 layers of 896), random weights, on `--task shapes` with 224-pixel pictures (64 image tokens each), hf trainer and
transformers engine.

Two runs through the program: bf16 (the speed row: step, generate, train, weight sync, medians of steps 3 to the end)
and float32 (the parity row: the trainer's and the generator's logprobs of the sampled tokens on image prompts, whose
gap the program reports as logprob_diff_mean / _max). Prints a table last and writes $OUT/vision_gpu.json.

    python3 bench/vision_gpu.py                 # on a GPU machine; carry .whl (../shared/gpu/make-wheels.sh)
    python3 bench/vision_gpu.py --tiny          # the same on a tiny model on CPU (a smoke test of the script)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import ensure_meshrl_layout  # noqa: E402

# Qwen2.5-VL's released vision tower (all sizes) and Qwen2.5-0.5B's language model.
REAL = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864,
            vision_hidden_size=1280, vision_depth=32, vision_num_heads=16, vision_intermediate_size=3420,
            vision_window_tokens=4, vision_full_attention_every=8, max_position_embeddings=4096)  # fmt: skip
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, vision_hidden_size=64, vision_depth=2,
            vision_num_heads=2)  # fmt: skip


def make_model(out: Path, *, tiny: bool, image_size: int) -> Path:
    import torch

    from meshrl.models.tiny_vlm import create_tiny_vlm
    from meshrl.tasks.setup import task_texts
    from meshrl.tasks.shapes import ShapesConfig, build_shapes_task

    if (out / "config.json").exists():
        return out
    texts = task_texts(build_shapes_task(ShapesConfig(num_train=2000, num_eval=32, image_size=image_size)))
    on = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    with on:  # drawn on the GPU: seconds instead of minutes of CPU init for ~1.2 B parameters
        create_tiny_vlm(out, "qwen2_5_vl", vocab_size=2048, texts=texts, seed=0, dtype=torch.bfloat16,
                        min_pixels=image_size * image_size, max_pixels=image_size * image_size,
                        initializer_range=0.02, **(TINY if tiny else REAL))  # fmt: skip
    return out


def run_program(
    model: Path,
    name: str,
    dtype: str,
    steps: int,
    image_size: int,
    runs: Path,
    log: Path,
    engine: str = "transformers",
    extra: tuple[str, ...] = (),
) -> float:
    cpu = bool(os.environ.get("VISION_GPU_CPU"))
    flags = {
        "--model.path": model, "--model.backend": "hf", "--model.dtype": dtype, "--generator.dtype": dtype,
        "--trainer.device": "cpu" if cpu else "cuda", "--trainer.num-procs": 1, "--generator.engine": engine,
        "--generator.max-model-len": 96 if cpu else 160, "--generator.max-tokens": 32, "--task": "shapes",
        "--shapes.image-size": image_size, "--shapes.num-train": 2000, "--shapes.num-eval": 32,
        "--grpo.prompts-per-step": 4 if cpu else 32, "--grpo.group-size": 2 if cpu else 8, "--grpo.steps": steps,
        "--warmup.steps": 0, "--eval.samples": 0, "--run.output-dir": runs, "--run.name": name,
    }  # fmt: skip
    args = [sys.executable, "-m", "meshrl.controller.grpo", "--run.no-gpu-defaults"]
    args += [str(x) for kv in flags.items() for x in kv] + list(extra)
    t0 = time.perf_counter()
    limit = int(os.environ.get("VISION_GPU_TIMEOUT", 300))
    marker = f"{name}-{os.getpid()}-{time.time_ns()}"
    with open(log, "w") as f:
        # Its own session, so that a run over the limit is stopped with its actor processes; the steps it wrote to
        # metrics.jsonl are still summarised.
        env = {**os.environ, "VISION_GPU_RUN": marker}
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"{name}: stopped at the {limit} s limit (VISION_GPU_TIMEOUT); summarising the steps it logged")
    # Processes outside the run's process group (a vLLM EngineCore under a Monarch process that has its own) outlive
    # a killed run and keep their GPU memory: on one H100 an orphaned EngineCore kept 48 GiB, and the next run's vLLM
    # refused to start. They inherited the marker.
    _kill_marked(marker)
    return time.perf_counter() - t0


def _kill_marked(marker: str) -> None:
    needle = f"VISION_GPU_RUN={marker}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                os.kill(int(pid), signal.SIGKILL)
                print(f"killed process {pid}, left over from the run", flush=True)
        except OSError:
            pass


def summarise(run_dir: Path, wall_s: float) -> dict:
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    rl = [r for r in records if r.get("phase") == "rl"]
    timed = rl[2:] or rl
    m = lambda k: statistics.median(r[k] for r in timed)  # noqa: E731
    return {
        "steps": len(rl), "wall_s": wall_s, "step_s": m("time_step_s"), "generate_s": m("time_generate_s"),
        "train_s": m("time_train_s"), "sync_s": m("time_weight_sync_s"),
        "logprob_diff_mean": statistics.fmean(r["logprob_diff_mean"] for r in rl),
        "logprob_diff_max": max(r["logprob_diff_max"] for r in rl),
        "peak_gib": max((r.get("memory/train/trainer0_peak_gib") or 0.0) for r in rl),
        "tokens_trained": m("tokens_trained"), "step_times_s": [round(r["time_step_s"], 3) for r in rl],
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model (a CPU smoke test of this script)")
    ap.add_argument("--steps", type=int, default=8, help="GRPO steps of the bf16 run (the float32 run: 3)")
    ap.add_argument("--image-size", type=int, default=224, help="pixels a side (224: 64 image tokens a picture)")
    ap.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        default="transformers",
        help="the generator engine (vllm: the vLLM pieces of bench/gpu_run.sh vision-vllm)",
    )
    ap.add_argument("--rows", default="bf16,fp32", help="which runs, comma-separated: bf16 (speed), fp32 (parity)")
    ap.add_argument(
        "--program-args",
        default="",
        help="more flags for the program, space-separated (e.g. '--generator.vllm.enforce-eager True'): an A/B row",
    )
    ap.add_argument("--tag", default="", help="a suffix for the rows' names and files (e.g. eager), for an A/B row")
    args = ap.parse_args()
    ensure_meshrl_layout()
    out = Path(os.environ.get("OUT", "/tmp/out"))
    work = Path(os.environ.get("VISION_GPU_DIR", "/tmp/vision_gpu"))
    out.mkdir(parents=True, exist_ok=True)
    image_size = 56 if args.tiny else args.image_size
    if args.tiny:
        os.environ["VISION_GPU_CPU"] = "1"
    t0 = time.perf_counter()
    model = make_model(work / ("tiny" if args.tiny else "model"), tiny=args.tiny, image_size=image_size)
    cfg = json.loads((model / "config.json").read_text())
    print(f"model made in {time.perf_counter() - t0:.0f} s: {cfg['architectures']}, vision depth "
          f"{cfg['vision_config']['depth']} x {cfg['vision_config']['hidden_size']}", flush=True)  # fmt: skip
    rows = {}
    wanted = set(args.rows.split(","))
    for name, dtype, steps in (("bf16", "bfloat16", args.steps), ("fp32", "float32", 3)):
        if name not in wanted:
            continue
        name = name if args.engine == "transformers" else f"{name}_{args.engine}"
        name = f"{name}_{args.tag}" if args.tag else name
        run_dir = work / "runs" / name
        if run_dir.exists():
            import shutil

            shutil.rmtree(run_dir)
        log = out / f"vision_gpu_{name}.log"
        wall = run_program(
            model, name, dtype, steps, image_size, work / "runs", log, args.engine, tuple(args.program_args.split())
        )
        for f in ("metrics.jsonl", "timeline.png"):
            if (run_dir / f).exists():
                (out / f"vision_gpu_{name}_{f}").write_bytes((run_dir / f).read_bytes())
        try:
            rows[name] = summarise(run_dir, wall)
        except (OSError, StopIteration, statistics.StatisticsError):
            rows[name] = {"failed": True}
            print(f"{name}: FAILED; the log's end:\n" + "".join(open(log).readlines()[-25:]), flush=True)
    suffix = ("" if args.engine == "transformers" else "_" + args.engine) + (f"_{args.tag}" if args.tag else "")
    (out / f"vision_gpu{suffix}.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'run':10} {'steps':>5} {'step s':>7} {'generate':>8} {'train':>6} {'sync s':>7} {'diff mean':>10} "
          f"{'diff max':>9} {'peak GiB':>8} {'wall s':>6}")  # fmt: skip
    for name, r in rows.items():
        if r.get("failed"):
            print(f"{name:10} FAILED (vision_gpu_{name}.log)")
            continue
        print(f"{name:10} {r['steps']:5} {r['step_s']:7.2f} {r['generate_s']:8.2f} {r['train_s']:6.2f} "
              f"{r['sync_s']:7.3f} {r['logprob_diff_mean']:10.2e} {r['logprob_diff_max']:9.2e} {r['peak_gib']:8.1f} "
              f"{r['wall_s']:6.0f}")  # fmt: skip
    print("(diff: the trainer's vs the generator's logprob of each sampled token, nats; mean over steps, max of all)")
    return 0 if not any(r.get("failed") for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
