#!/usr/bin/env bash
# Sets up .venv (fast when nothing changed) and runs the test suite. Extra arguments go to pytest.
#
# Lanes (tests/README.md; tests/conftest.py assigns them, so test files carry no lane marks):
#   ./scripts/test.sh                              the full lane, what CI runs (.ci/run): every test; gpu ones skip on CPU
#   ./scripts/test.sh -m "not slow"                the fast lane: `unit` tests only, in this process (<= 3 min here)
#   ./scripts/test.sh -m actors | -m e2e           tests that start processes | that run a whole program
#   ./scripts/test.sh -m gpu                       tests that need CUDA (bench/gpu_run.sh runs them on the GPU machine)
#   ./scripts/test.sh tests/test_losses.py -k kl   one file, some tests
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ $rc -eq 5 ]; then
  # pytest exit code 5: no tests were collected. With a filter (-k, a path) that is a clear "nothing
  # matched", not a crash; without one the suite is missing, which is a failure.
  if [ $# -gt 0 ]; then echo "[test] no tests matched: $*"; exit 0; fi
  echo "[test] no tests were collected: the suite is missing"; exit 1
fi
exit $rc
