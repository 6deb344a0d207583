#!/usr/bin/env bash
# Runs every test: unit, end-to-end (real nats-server, real ZMQ, vLLM's own classes),
# plugin, chart and the benchmark smoke run. `make test` and .ci/run call this.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
if [ -f scripts/install-chart-tools.sh ]; then
  bash scripts/install-chart-tools.sh
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
