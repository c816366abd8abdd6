#!/usr/bin/env bash
# Diagnosis of a run that stops making progress on several GPUs (issue 33: the four-GPU two-rank layout stalled after
# its first step at 4x the work): runs bench/gpu_check.sh rows one at a time and, while each runs, records
#   - every 30 s, each process's GPU memory (nvidia-smi) -> dumps/<row>.smi
#   - from 90 s on, every 40 s, a py-spy dump with native frames of the controller and every actor process
#     (where each thread waits: an NCCL kernel, cudaMalloc, a lock) -> dumps/<row>.pyspy
#   - the trainer's collectives: a collective that waits 45 s fails the trainer (--trainer.collective-timeout-s) and
#     each rank's flight recorder (its last collectives, in order) is written to fr/<row>/trace_<rank>
# and kills every leftover process of the row before the next one (a row that timed out must not hold the GPUs).
#
#   OUT=/tmp/out bash bench/stall_probe.sh gpus4-x4work gpus4-x4work-tstore gpus4-x4work-1gen
#   python3 bench/stall_probe.py $OUT/fr/gpus4-x4work     # the ranks' collective sequences, side by side
#   STALL_DUMPS=0 STALL_TIMEOUT=300 bash bench/stall_probe.sh 1gpu gpus4-x4work   # timings: no py-spy pauses
#
# Carry `.whl` (with py-spy). Everything lands in $OUT/probe.tgz (the device returns few files).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/dumps" "$OUT/fr"
PYSPY=${PYSPY:-/tmp/site211/bin/py-spy}
export TORCH_NCCL_TRACE_BUFFER_SIZE=20000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_DESYNC_DEBUG=1

monitor() {
  local row=$1 t=0
  while sleep 10; do
    t=$((t + 10))
    if [ $((t % 30)) -eq 0 ]; then
      { echo "== t=${t}s"; nvidia-smi --query-compute-apps=pid,used_memory,gpu_bus_id --format=csv,noheader; } \
        >> "$OUT/dumps/$row.smi" 2>&1
    fi
    if [ "${STALL_DUMPS:-1}" = 1 ] && [ $t -ge 90 ] && [ $(((t - 90) % 40)) -eq 0 ]; then
      for pid in $(pgrep -f "bootstrap_main|meshrl.controller.grpo"); do
        { echo "== t=${t}s pid $pid: $(tr '\0' ' ' < "/proc/$pid/cmdline" 2> /dev/null | cut -c1-60)"
          timeout 25 "$PYSPY" dump --native --pid "$pid"; } >> "$OUT/dumps/$row.pyspy" 2>&1
      done
    fi
  done
}

for row in "$@"; do
  mkdir -p "$OUT/fr/$row"
  export TORCH_FR_DUMP_TEMP_FILE="$OUT/fr/$row/trace_" TORCH_NCCL_DEBUG_INFO_TEMP_FILE="$OUT/fr/$row/trace_"
  monitor "$row" &
  mon=$!
  OUT="$OUT/$row" GPU_CHECK_RUNS="$OUT/$row/runs" GPU_CHECK_TIMEOUT=${STALL_TIMEOUT:-170} \
    GPU_CHECK_FLAGS="--trainer.collective-timeout-s 45 ${STALL_FLAGS:-}" \
    bash bench/gpu_check.sh "$row"
  kill "$mon" 2> /dev/null
  pkill -9 -f "bootstrap_main|meshrl.controller.grpo"
  sleep 3
done
# each row's run directory ($OUT/<row>/runs/<row>): keep the logs and metrics, not the checkpoints (GBs to pack)
find "$OUT" -mindepth 3 -maxdepth 4 \( -name checkpoints -o -name final_model \) -type d -prune -exec rm -rf {} +
(cd "$OUT" && tar czf /tmp/probe.tgz --exclude probe.tgz . && find . -mindepth 1 -delete && mv /tmp/probe.tgz .)
ls -la "$OUT"
