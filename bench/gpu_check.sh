#!/usr/bin/env bash
# The GPU check anyone can run on a GPU machine (issue 32): the real program — `python -m meshrl.controller.grpo`
# itself, not a bench loop — in named layouts on one and two GPUs, then one table (step, generate, train, weight
# sync, overlap of generation and training, logprob gap; ratios against the first layout of the call) and JSON; and
# the GPU-only tests. The job: the arithmetic task on a 0.6B-shaped Qwen3 (random weights; the tiny checkpoint's BPE
# tokenizer, the vocabulary sized to it so the launch checks pass), 32 prompts x 8 samples, 256 new tokens, hf
# trainer and transformers engine in bf16 (../shared/GPU.md, "Running the real program there").
#
#   bash bench/gpu_check.sh                         # 1gpu, gpus2 and split-sync (those the GPUs allow), the GPU tests
#   bash bench/gpu_check.sh all                     # every layout the machine's GPUs allow (over 10 min on 2 GPUs)
#   bash bench/gpu_check.sh 1gpu split-async        # some layouts (names below); `tests`: the GPU-only tests
#   GPU_CHECK_TREES="/tmp/before ." bash bench/gpu_check.sh 1gpu   # a baseline tree (e.g. an older commit's `git
#                                                   # archive`) and this one, same flags, same machine
#   GPU_CHECK_STEPS=10 GPU_CHECK_FLAGS="--grpo.group-size 4" bash bench/gpu_check.sh split-async
#
# Carry `.whl` (../shared/gpu/make-wheels.sh). Step times are medians of steps 3 to the end; the overlap is the
# time generation (a generator's generate and pull_weights) and training (trainer rank 0's forward_backward) run at
# once over the last 5 steps, as a share of the shorter of the two. Prints the table last; JSON in
# $OUT/gpu_check.json, each run's log, metrics.jsonl and timeline.png under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
STEPS=${GPU_CHECK_STEPS:-8}
RUNS=${GPU_CHECK_RUNS:-/tmp/gc/runs}  # the runs' directories (metrics.jsonl is written as each step ends)
mkdir -p "$OUT" /tmp/gc
[ -d /tmp/site211/monarch ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site211 .whl/*.whl || exit 1
here=$PWD
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")

FAST="--trainer.compile --trainer.logprob-chunk-size 4096 --trainer.master-dtype bfloat16"
declare -A LAYOUT=(
  [1gpu]=""                                                        # trainer and generator share GPU 0, synchronous
  [1gpu-fast]="$FAST"
  [split-sync]="--trainer.devices 0 --generator.devices 1"         # trainer GPU 0, generator GPU 1
  [split-async]="--trainer.devices 0 --generator.devices 1 --grpo.max-staleness 1"
  [split-async-fast]="--trainer.devices 0 --generator.devices 1 --grpo.max-staleness 1 $FAST"
  # a second generator on the trainer's GPU: generation on both GPUs, training on GPU 0
  [split2-async]="--trainer.devices 0 --generator.num-replicas 2 --generator.devices 1 0 --grpo.max-staleness 1"
  [split2-async-fast]="--trainer.devices 0 --generator.num-replicas 2 --generator.devices 1 0 --grpo.max-staleness 1 $FAST"
  # what --placement.gpus 2 chooses (split-async, by the flag a user gives)
  [gpus2]="--placement.gpus 2"
  [gpus2-fast]="--placement.gpus 2 $FAST"
  [gpus2-mb128]="--placement.gpus 2 --trainer.micro-batch-size 128"
  # four GPUs (issue 33): candidates for the layout --placement.gpus 4 chooses
  # one trainer rank alone on GPU 0, a generator on each of the other three
  [split4]="--trainer.devices 0 --trainer.micro-batch-size 128 --generator.num-replicas 3 --generator.devices 1 2 3 --grpo.max-staleness 1"
  # two FSDP trainer ranks on GPUs 0-1, generators on 2-3
  [split4-2tr]="--trainer.num-procs 2 --trainer.devices 0 1 --trainer.micro-batch-size 128 --generator.num-replicas 2 --generator.devices 2 3 --grpo.max-staleness 1"
  # colocated: four trainer ranks and a generator on every GPU, the synchronous loop (what verl users know)
  [coloc4]="--trainer.num-procs 4 --trainer.devices 0 1 2 3 --generator.num-replicas 4 --generator.devices 0 1 2 3"
  [coloc2]="--trainer.num-procs 2 --trainer.devices 0 1 --generator.num-replicas 2 --generator.devices 0 1"
  [coloc4-mb128]="--trainer.num-procs 4 --trainer.devices 0 1 2 3 --generator.num-replicas 4 --generator.devices 0 1 2 3 --trainer.micro-batch-size 128"
  # what --placement.gpus 4 chooses (split4-2tr, micro-batches of 128 per rank), on the job and on 4x the job
  [gpus4]="--placement.gpus 4"
  [gpus4-fast]="--placement.gpus 4 $FAST"
  [gpus4-x4work]="--placement.gpus 4 --grpo.prompts-per-step 128"
  # weak scaling (issue 33, bench/scaling.py): the job grown with the GPUs; FSDP's gradient reduce-scatter once a step
  [gpus2-x2work]="--placement.gpus 2 --grpo.prompts-per-step 64"
  [coloc2-x2work]="--placement.gpus 2 --placement.layout colocated --grpo.prompts-per-step 64"
  [gpus4-defer]="--placement.gpus 4 --trainer.defer-grad-sync"
  # the trainer alone, one rank and two, at the same per-rank call size (a fixed token budget), one generator
  [split-x2work-b32k]="--trainer.devices 0 --generator.devices 1 --grpo.max-staleness 1 --trainer.micro-batch-size 128 --grpo.prompts-per-step 64 --trainer.max-tokens-per-micro-batch 32768"
  [split3-2tr-x4work-b32k]="--trainer.num-procs 2 --trainer.devices 0 1 --generator.devices 2 --grpo.max-staleness 1 --trainer.micro-batch-size 256 --grpo.prompts-per-step 128 --trainer.max-tokens-per-micro-batch 32768"
  [gpus4-x4work-defer]="--placement.gpus 4 --grpo.prompts-per-step 128 --trainer.defer-grad-sync"
  # the two-rank four-GPU layout stalled after its first step at 4x the work (bench/NOTES.md, fourth session):
  # the same with a fixed 24k-token call, with weights through torchstore instead of rank 0's CUDA IPC buffer, and
  # with one generator (the split3 row, which ran, on the same GPUs)
  [gpus4-x4work-b24k]="--placement.gpus 4 --grpo.prompts-per-step 128 --trainer.max-tokens-per-micro-batch 24576"
  [gpus4-x4work-tstore]="--placement.gpus 4 --grpo.prompts-per-step 128 --generator.weight-sync torchstore"
  [gpus4-x4work-1gen]="--placement.gpus 4 --grpo.prompts-per-step 128 --generator.num-replicas 1 --generator.devices 2"
  [coloc2-mb64]="--trainer.num-procs 2 --trainer.devices 0 1 --generator.num-replicas 2 --generator.devices 0 1 --trainer.micro-batch-size 64"
  # no settings but the job's: what the GPU defaults choose on this machine (every GPU it has)
  [auto]=""
)
ORDER=(1gpu 1gpu-fast split-sync split-async split-async-fast split2-async split2-async-fast gpus2 gpus2-fast coloc2
       coloc2-mb64 split4 split4-2tr coloc4 coloc4-mb128 gpus4 gpus4-fast gpus4-x4work gpus2-x2work coloc2-x2work gpus4-defer
       gpus4-x4work-defer gpus4-x4work-b24k gpus4-x4work-tstore gpus4-x4work-1gen split-x2work-b32k split3-2tr-x4work-b32k
       auto)
GPUS_NEEDED() { case "$1" in 1gpu* | auto) echo 1 ;; split3*) echo 3 ;; *4*) echo 4 ;; *) echo 2 ;; esac; }

names=("$@")
if [ ${#names[@]} -eq 0 ]; then  # the check (one device call): 1 GPU, the 2- and 4-GPU defaults, tests
  for n in 1gpu gpus2 gpus4 auto; do [ "$(GPUS_NEEDED "$n")" -le "$gpus" ] && names+=("$n"); done
  names+=(tests)
elif [ " ${names[*]} " = " all " ]; then  # every layout this machine's GPUs allow (two device calls' worth)
  names=()
  for n in "${ORDER[@]}"; do [ "$(GPUS_NEEDED "$n")" -le "$gpus" ] && names+=("$n"); done
fi

if [ " ${names[*]} " != " tests " ] && [ ! -f /tmp/gc/model/config.json ]; then
  # One model for every run, made with this tree's scripts: the tokenizer of a tiny checkpoint, a 0.6B body.
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

# The job, and (EXPLICIT) the settings every named layout states itself, the GPU defaults off (meshrl.gpu_defaults);
# the `auto` layout gives the job alone, as a user would, and lets the GPU defaults choose the rest.
JOB="--model.path /tmp/gc/model --generator.max-model-len 320 --generator.max-tokens 256
  --task arithmetic --arithmetic.num-eval 32 --reward exact=1.0 --eval.verifier exact --grpo.prompts-per-step 32
  --grpo.group-size 8 --grpo.steps $STEPS --warmup.steps 0 --eval.samples 0 --run.output-dir $RUNS"
EXPLICIT="--run.no-gpu-defaults --model.backend hf --model.dtype bfloat16 --trainer.device cuda
  --generator.engine transformers --generator.dtype bfloat16"
# One trainer rank unless the layout says otherwise. Not for --placement.gpus rows: a --trainer.num-procs given there is
# the user's count, and the layout would keep it (the 4-GPU rows ran one trainer rank this way until 2026-11-27).
explicit() { case " $1 " in *" --placement.gpus "* | *" --trainer.num-procs "*) echo "$EXPLICIT" ;;
  *) echo "$EXPLICIT --trainer.num-procs 1" ;; esac; }
read -r -a trees <<< "${GPU_CHECK_TREES:-.}"
assemble() {  # the meshrl namespace of tree $1 as pyproject's package-dir lays it out, under /tmp/gc/pkg$2
  rm -rf "/tmp/gc/pkg$2" && mkdir -p "/tmp/gc/pkg$2" && cp -r "$1/src/meshrl" "/tmp/gc/pkg$2/" || return 1
  for d in actors controller configs; do cp -r "$1/$d" "/tmp/gc/pkg$2/meshrl/" || return 1; done
}
rows=()
for name in "${names[@]}"; do
  if [ "$name" = tests ]; then
    # The GPU-only tests (the `gpu` lane, tests/README.md) on this machine's torch stack; those that need vLLM or
    # torchtitan skip themselves here (bench/gpu_run.sh carries those stacks).
    assemble "$here" t || exit 1
    (PYTHONPATH=/tmp/site211:/tmp/gc/pkgt timeout "${GPU_CHECK_TEST_TIMEOUT:-420}" python3 -m pytest -q \
      -p no:cacheprovider -m gpu --continue-on-collection-errors -rs tests 2>&1 | grep -v -E "Warning|warnings.warn" \
      | tail -40 | tee "$OUT/gpu_tests.log")
    continue
  fi
  [ -n "${LAYOUT[$name]+x}" ] || { echo "unknown layout $name (known: ${ORDER[*]} tests)"; exit 2; }
  for i in "${!trees[@]}"; do
    tree=$(cd "${trees[$i]}" && pwd)
    run=$name
    [ ${#trees[@]} -gt 1 ] && run="$name-t$i"
    assemble "$tree" "$i" || exit 1
    rm -rf "$RUNS/$run"  # a run of an earlier call on this machine: never read as this one's
    echo "== $run: ${LAYOUT[$name]} ($tree)"
    (cd /tmp/gc && PYTHONPATH=/tmp/site211:/tmp/gc/pkg$i timeout "${GPU_CHECK_TIMEOUT:-400}" \
      python3 -m meshrl.controller.grpo $JOB $([ "$name" = auto ] || explicit "${LAYOUT[$name]}") ${LAYOUT[$name]} ${GPU_CHECK_FLAGS:-} --run.name "$run" 2>&1 \
      | grep -v -E "Warning|warnings.warn" > "$OUT/gpu_check_$run.log"; tail -4 "$OUT/gpu_check_$run.log"; \
      grep -E "weight sync:|placement:" "$OUT/gpu_check_$run.log")
    for f in metrics.jsonl timeline.png; do cp "$RUNS/$run/$f" "$OUT/gpu_check_${run}_$f" 2>/dev/null; done
    rows+=("$run:$name:$tree")
  done
done
[ ${#rows[@]} -gt 0 ] || exit 0
python3 - "$OUT" "$RUNS" "${rows[@]}" <<'EOF'
import json, statistics, sys

out, runs, rows = sys.argv[1], sys.argv[2], sys.argv[3:]


def union(spans):
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def phases(intervals, steps):
    """Over the last `steps` step times: (generation ∩ training as a share of the shorter of the two, seconds in
    which some generator was generating)."""
    ends = [i["end"] for i in intervals if i["what"] in ("forward_backward", "push_weights")]
    if not ends or not steps:
        return float("nan"), float("nan")
    hi = max(ends)
    lo = hi - sum(steps)
    clip = lambda i: (max(i["start"], lo), min(i["end"], hi))  # noqa: E731
    gen = [clip(i) for i in intervals if i["actor"].startswith("generator") and i["what"] in ("generate", "pull_weights")]
    train = [clip(i) for i in intervals if i["actor"] == "trainer:0" and i["what"] == "forward_backward"]
    generating = [clip(i) for i in intervals if i["actor"].startswith("generator") and i["what"] == "generate"]
    gen, train = [g for g in gen if g[1] > g[0]], [t for t in train if t[1] > t[0]]
    g, t = union(gen), union(train)
    both = sum(max(0.0, min(b1, b2) - max(a1, a2)) for a1, b1 in g for a2, b2 in t)
    shorter = min(sum(b - a for a, b in g), sum(b - a for a, b in t))
    busy = sum(b - a for a, b in union([s for s in generating if s[1] > s[0]]))
    return (both / shorter if shorter > 0 else float("nan")), busy


results = []
for arg in rows:
    run, layout, tree = arg.split(":", 2)
    try:
        records = [json.loads(l) for l in open(f"{runs}/{run}/metrics.jsonl")]
        intervals = [json.loads(l) for l in open(f"{runs}/{run}/timeline.jsonl")]
    except OSError:
        results.append({"run": run, "layout": layout, "tree": tree, "failed": True})
        continue
    rl = [r for r in records if r.get("phase") == "rl"][2:]
    prompts = json.load(open(f"{runs}/{run}/config.json"))["grpo"]["prompts_per_step"]
    m = lambda k: statistics.median(r[k] for r in rl) if rl else float("nan")  # noqa: E731
    last = rl[-5:]
    overlap, generating_s = phases(intervals, [r["time_step_s"] for r in last])
    results.append({
        "run": run, "layout": layout, "tree": tree, "steps": len(rl), "step_s": m("time_step_s"),
        "generate_s": m("time_generate_s"), "train_s": m("time_train_s"), "sync_s": m("time_weight_sync_s"),
        "overlap": overlap,
        # generation tokens/s: the model tokens of the last steps over the time some generator was generating then;
        # training tokens/s: prompt and completion tokens trained over the train phase (medians of the steps)
        "generate_tokens_per_s": sum(r.get("tokens_generated", 0) for r in last) / generating_s if generating_s else 0.0,
        "train_tokens_per_s": statistics.median(r.get("tokens_trained", 0) / r["time_train_s"] for r in rl) if rl else 0.0,
        "logprob_diff_mean": m("logprob_diff_mean"), "logprob_diff_max": max(r["logprob_diff_max"] for r in rl),
        "prompts_per_step": prompts, "tokens_per_s": m("tokens_per_s"),
        "step_times_s": [round(r["time_step_s"], 3) for r in rl],
        "train_times_s": [round(r["time_train_s"], 3) for r in rl],
        # the trainer's allocator retries (cumulative; a rise is a step that freed the cache and retried a cudaMalloc)
        "alloc_retries": [r.get("memory/train/trainer0_alloc_retries") for r in rl],
        "micro_batches": [r.get("micro_batches") for r in rl],
        "peak_gib": max((r.get("memory/train/trainer0_peak_gib") or 0.0) for r in rl) if rl else None,
        "transport": next((l.split("weight sync: ")[1].split()[0] for l in open(f"{out}/gpu_check_{run}.log")
                           if "weight sync: " in l), "?"),
    })
first = next((r for r in results if not r.get("failed")), {})
base, base_prompts = first.get("step_s", float("nan")), first.get("prompts_per_step", 1)
for r in results:
    # a run of k times the first run's prompts per step is compared per unit of work (weak scaling)
    r["work"] = r.get("prompts_per_step", base_prompts) / base_prompts
    r["step_ratio"] = r.get("step_s", float("nan")) / base / r["work"]
json.dump(results, open(f"{out}/gpu_check.json", "w"), indent=1)
print(f"\n{'run':20} {'work':>4} {'step s':>7} {'ratio':>6} {'generate':>9} {'train':>6} {'sync s':>7} {'overlap':>8} "
      f"{'diff mean':>9} {'gen tok/s':>9} {'train tok/s':>11} {'peak GiB':>8} {'transport':>10}")
for r in results:
    if r.get("failed"):
        print(f"{r['run']:20} FAILED (see gpu_check_{r['run']}.log)")
        continue
    print(f"{r['run']:20} {r['work']:4.0f} {r['step_s']:7.2f} {r['step_ratio']:6.2f} {r['generate_s']:9.2f} "
          f"{r['train_s']:6.2f} {r['sync_s']:7.3f} {r['overlap']:8.0%} {r['logprob_diff_mean']:9.4f} "
          f"{r['generate_tokens_per_s']:9.0f} {r['train_tokens_per_s']:11.0f} {r['peak_gib'] or 0:8.1f} "
          f"{r['transport']:>10}")
for r in results:
    if not r.get("failed"):
        print(f"{r['run']:20} steps {r['step_times_s']} train {r['train_times_s']} "
              f"calls {r['micro_batches']} allocator retries {r['alloc_retries']} peak {r['peak_gib']} GiB")
print("(generate: the controller's wait for the step's round; asynchronous runs wait only for what training did "
      "not hide. ratio: step time over the first run's, per unit of work: work = prompts per step over the first "
      "run's.)")
EOF
