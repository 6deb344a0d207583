#!/usr/bin/env bash
# Runs every test: unit, end-to-end (real nats-server, real ZMQ, vLLM's own classes),
# plugin, chart and the benchmark smoke run. `make test` and .ci/run call this.
#
# `--fast` (`make test-fast`): only the in-process tests (not marked `process` by
# tests/conftest.py) with the `fast` Hypothesis profile, for the edit-test loop.
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
if [ "${1:-}" = "--fast" ]; then
  shift
  export HYPOTHESIS_PROFILE=fast
  set -- -m "not process" "$@"
else
  [ -f scripts/install-chart-tools.sh ] && bash scripts/install-chart-tools.sh
  # the full run names its slowest tests, so CI's log shows where its time goes
  set -- --durations=25 "$@"
fi
export PATH="$PWD/.tools/bin:$PATH"
set +e
"$BIN/python" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
