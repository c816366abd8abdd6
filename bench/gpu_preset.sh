#!/usr/bin/env bash
# The GPU preset through the real program (issue 33): `python -m meshrl.controller.grpo --preset gpu-math` on a GPU
# machine, every GPU setting left to the GPU defaults (it prints what they resolved). SFT warm-up, then GRPO;
# held-out greedy accuracy before RL and every 25 RL steps. Prints wall time per phase and the accuracy curve last;
# the log, metrics.jsonl, summary.json and the plots under $OUT.
#
#   CUDA_VISIBLE_DEVICES=0 bash bench/gpu_preset.sh              # one GPU (as measured in bench/NOTES.md)
#   bash bench/gpu_preset.sh --grpo.steps 50                     # more flags go to the program
#
# Carry `.whl` (../shared/gpu/make-wheels.sh math_verify latex2sympy2_extended antlr4-python3-runtime==4.13.2: the
# preset's reward is math-verify's).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/gp
[ -d /tmp/site211/monarch ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site211 .whl/*.whl || exit 1
# The meshrl namespace as pyproject's package-dir lays it out.
rm -rf /tmp/gp/pkg && mkdir -p /tmp/gp/pkg && cp -r src/meshrl /tmp/gp/pkg/ || exit 1
for d in actors controller configs; do cp -r "$d" /tmp/gp/pkg/meshrl/ || exit 1; done
rm -rf /tmp/gp/runs/gpu-math
start=$(date +%s)
(cd /tmp/gp && PYTHONPATH=/tmp/site211:/tmp/gp/pkg timeout "${GPU_PRESET_TIMEOUT:-900}" python3 -m meshrl.controller.grpo \
  --preset gpu-math --run.output-dir /tmp/gp/runs --run.name gpu-math "$@" 2>&1 \
  | grep -v -E "Warning|warnings.warn" > "$OUT/gpu_math.log")
wall=$(($(date +%s) - start))
grep -E "gpu defaults|placement" "$OUT/gpu_math.log" | head -20
tail -5 "$OUT/gpu_math.log"
for f in metrics.jsonl summary.json reward_curve.png timeline.png training.png; do
  cp "/tmp/gp/runs/gpu-math/$f" "$OUT/gpu_math_$f" 2>/dev/null
done
python3 - "$OUT" "$wall" <<'PY'
import json, statistics, sys
from pathlib import Path

out, wall = Path(sys.argv[1]), int(sys.argv[2])
path = out / "gpu_math_metrics.jsonl"
if not path.exists():
    print(f"gpu-math: no metrics (wall {wall} s); see {out / 'gpu_math.log'}")
    sys.exit(1)
records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
warm = [r for r in records if r.get("phase") == "warmup"]
rl = [r for r in records if r.get("phase") == "rl"]
evals = [r for r in records if r.get("phase") == "eval"]
result = {
    "wall_s": wall,
    "warmup_steps": len(warm),
    "rl_steps": len(rl),
    "rl_step_s_median": statistics.median(r["time_step_s"] for r in rl) if rl else None,
    "reward_first5": statistics.fmean(r["reward_mean"] for r in rl[:5]) if rl else None,
    "reward_last5": statistics.fmean(r["reward_mean"] for r in rl[-5:]) if rl else None,
    "eval": [{k: v for k, v in r.items() if k in ("when", "step", "accuracy") or "@" in k} for r in evals],
}
(out / "gpu_math.json").write_text(json.dumps(result, indent=2))
print(f"\ngpu-math: wall {wall} s (start-up included), {len(warm)} warm-up steps, {len(rl)} RL steps, "
      f"RL step median {result['rl_step_s_median'] and round(result['rl_step_s_median'], 3)} s")
print(f"reward (sampled) first 5 RL steps {result['reward_first5']}, last 5 {result['reward_last5']}")
for e in result["eval"]:
    figures = ", ".join(f"{k} {v:.3f}" for k, v in e.items() if k not in ("when", "step"))
    print(f"  held-out {e['when']:>8} step {e['step']}: {figures}")
PY
