#!/usr/bin/env bash
# The real program on the GPU machine (../shared/GPU.md, "Running the real program there"): `python -m
# meshrl.controller.grpo` itself, not a bench loop, on the arithmetic task with a 0.6B-shaped Qwen3 (random weights;
# the tiny checkpoint's BPE tokenizer, the vocabulary sized to it so the launch checks pass), trainer and generator
# on one GPU. Each TREE given (a copy of the repository, e.g. an older commit's `git archive`) runs with the same
# flags in the same call, so before/after step times share the machine. Prints a table of step-time medians (steps
# 3 to the end) and copies each run's metrics.jsonl and timeline.png under $OUT.
#
#   bash bench/gpu_check.sh                      # this tree (carry .whl: ../shared/gpu/make-wheels.sh)
#   bash bench/gpu_check.sh /tmp/before .        # a baseline tree, then this one
#   GPU_CHECK_FLAGS="--grpo.max-staleness 1" GPU_CHECK_STEPS=10 bash bench/gpu_check.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS=${GPU_CHECK_STEPS:-8}
mkdir -p "$OUT" /tmp/gc
[ -d /tmp/site211/monarch ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site211 .whl/*.whl || exit 1
here=$PWD
trees=("$@")
[ ${#trees[@]} -gt 0 ] || trees=(.)

# One model for every tree, made with this tree's scripts: the tokenizer of a tiny checkpoint, a 0.6B body.
if [ ! -f /tmp/gc/model/config.json ]; then
  PYTHONPATH=/tmp/site211:$here/src python3 scripts/make_tiny_checkpoint.py --arch qwen3 --vocab-size 2048 \
    --max-position-embeddings 512 --out /tmp/gc/tok > /tmp/gc/tok.log 2>&1 || { tail -5 /tmp/gc/tok.log; exit 1; }
  PYTHONPATH=/tmp/site211:$here/bench python3 - <<'EOF' || exit 1
import json, shutil
from pathlib import Path

import torch
from common import QWEN3_06B
from transformers import Qwen3Config, Qwen3ForCausalLM

tok, out = Path("/tmp/gc/tok"), Path("/tmp/gc/model")
small = json.loads((tok / "config.json").read_text())
shape = {k: v for k, v in QWEN3_06B.items() if k not in ("vocab_size", "max_position_embeddings")}
keep = {k: small[k] for k in ("vocab_size", "max_position_embeddings", "eos_token_id", "bos_token_id", "pad_token_id")
        if k in small}
cfg = Qwen3Config(**shape, **keep, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                  architectures=["Qwen3ForCausalLM"])
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
model.save_pretrained(out)
for f in tok.iterdir():
    if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(f, out / f.name)
if (tok / "generation_config.json").exists():
    shutil.copy(tok / "generation_config.json", out / "generation_config.json")
print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters, vocabulary {cfg.vocab_size}")
EOF
fi

FLAGS="--model.path /tmp/gc/model --model.backend hf --model.dtype bfloat16 --trainer.device cuda --trainer.num-procs 1
  --generator.engine transformers --generator.dtype bfloat16 --generator.max-model-len 320 --generator.max-tokens 256
  --task arithmetic --arithmetic.num-eval 32 --reward exact=1.0 --eval.verifier exact --grpo.prompts-per-step 32
  --grpo.group-size 8 --grpo.steps $STEPS --warmup.steps 0 --eval.samples 0 --run.output-dir /tmp/gc/runs
  ${GPU_CHECK_FLAGS:-}"
rows=()
for i in "${!trees[@]}"; do
  tree=$(cd "${trees[$i]}" && pwd)
  name="run$i"
  rm -rf "/tmp/gc/pkg$i" && mkdir -p "/tmp/gc/pkg$i" && cp -r "$tree/src/meshrl" "/tmp/gc/pkg$i/" || exit 1
  for d in actors controller configs; do cp -r "$tree/$d" "/tmp/gc/pkg$i/meshrl/" || exit 1; done
  echo "== $tree"
  (cd /tmp/gc && PYTHONPATH=/tmp/site211:/tmp/gc/pkg$i timeout "${GPU_CHECK_TIMEOUT:-400}" \
    python3 -m meshrl.controller.grpo $FLAGS --run.name "$name" 2>&1 | grep -v -E "Warning|warnings.warn" \
    | tail -25 | tee "$OUT/gpu_check_$name.log")
  cp "/tmp/gc/runs/$name/metrics.jsonl" "$OUT/gpu_check_${name}_metrics.jsonl" 2>/dev/null
  cp "/tmp/gc/runs/$name/timeline.png" "$OUT/gpu_check_${name}_timeline.png" 2>/dev/null
  rows+=("$name:$tree")
done
python3 - "${rows[@]}" <<'EOF'
import json, statistics, sys
print(f"{'run':6} {'step s':>7} {'generate':>9} {'score':>6} {'train':>6} {'sync':>6} {'diff max':>9}  tree")
for arg in sys.argv[1:]:
    name, tree = arg.split(":", 1)
    try:
        rl = [json.loads(l) for l in open(f"/tmp/gc/runs/{name}/metrics.jsonl")]
    except OSError:
        print(f"{name:6} (no metrics)  {tree}")
        continue
    rl = [r for r in rl if r.get("phase") == "rl"][2:]
    m = lambda k: statistics.median(r[k] for r in rl) if rl else float("nan")  # noqa: E731
    print(f"{name:6} {m('time_step_s'):7.2f} {m('time_generate_s'):9.2f} {m('time_score_s'):6.2f} "
          f"{m('time_train_s'):6.2f} {m('time_weight_sync_s'):6.3f} {max(r['logprob_diff_max'] for r in rl):9.1e}  {tree}")
EOF
