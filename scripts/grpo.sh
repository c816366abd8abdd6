#!/usr/bin/env bash
# Sets up .venv (fast when nothing changed) and runs the main job: GRPO on the built-in string-reversal task
# with a tiny Qwen3 on this CPU. Extra arguments override the preset (see --help).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m meshrl.controller.grpo --preset tiny-reverse "$@"
