#!/usr/bin/env bash
# Sets up .venv (fast when nothing changed) and runs the test suite. Extra arguments go to pytest.
#
# Lanes (tests/README.md; tests/conftest.py assigns them, so test files carry no lane marks):
#   ./scripts/test.sh                              the full lane, what CI runs (.ci/run): every test; gpu ones skip on CPU
#   ./scripts/test.sh -m "not slow"                the fast lane: `unit` tests only, in the test processes (<= 3 min)
#   ./scripts/test.sh -m actors | -m e2e           tests that start processes | that run a whole program
#   ./scripts/test.sh -m gpu                       tests that need CUDA (bench/gpu_run.sh runs them on the GPU machine)
#   ./scripts/test.sh tests/test_losses.py -k kl   one file, some tests
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh || exit 1
# Two workers (pytest-xdist), whole modules each (their module-scoped runs are made once): the programs the tests
# start leave a core idle about a third of the time (imports, waits on heartbeats and timeouts), which the other
# worker fills: the full lane took 22-24 min this way against 34-37 min in one process on the 2-core machine. Pass -n 0
# (or -p no:xdist) for one process, e.g. to read a test's output with -s.
workers=(-n "${MESHRL_TEST_WORKERS:-2}" --dist loadfile)
for a in "$@"; do case "$a" in -n | -n[0-9]* | --numprocesses* | no:xdist) workers=() ;; esac; done
.venv/bin/python -m pytest -q "${workers[@]}" "$@"
rc=$?
if [ $rc -eq 5 ]; then
  # pytest exit code 5: no tests were collected. With a filter (-k, a path) that is a clear "nothing
  # matched", not a crash; without one the suite is missing, which is a failure.
  if [ $# -gt 0 ]; then echo "[test] no tests matched: $*"; exit 0; fi
  echo "[test] no tests were collected: the suite is missing"; exit 1
fi
exit $rc
