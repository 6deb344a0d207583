#!/usr/bin/env bash
# The process-level suites on a busy machine (issue 25): two CPU hogs (busy
# loops at the caller's nice level, 0 from a plain shell) run beside the fault,
# cluster, snapshot-process, security and engine suites, N runs in a row. The
# hogs are stopped at the end whatever happens; the first failed run ends it.
#   scripts/hog.sh                          # 5 runs of every suite
#   HOG_RUNS=3 scripts/hog.sh tests/faults/test_oversize_replay.py
#   HOG_PROCS=4 scripts/hog.sh -k failover  # more hogs; pytest arguments narrow it down
# Paths among the arguments replace the suites; anything else goes to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
RUNS="${HOG_RUNS:-5}"
PROCS="${HOG_PROCS:-2}"
SUITES=(tests/faults tests/cluster tests/snapshot/test_processes.py tests/security tests/engine)

paths=()
args=()
for a in "$@"; do
  if [[ "$a" != -* && -e "${a%%::*}" ]]; then paths+=("$a"); else args+=("$a"); fi
done
[ "${#paths[@]}" -gt 0 ] || paths=("${SUITES[@]}")

hogs=()
stop_hogs() {
  for pid in "${hogs[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${hogs[@]}"; do wait "$pid" 2>/dev/null || true; done
  hogs=()
}
trap stop_hogs EXIT
trap 'exit 130' INT TERM

for _ in $(seq "$PROCS"); do
  bash -c 'while :; do :; done' &
  hogs+=("$!")
done
echo "hog: ${#hogs[@]} busy processes (${hogs[*]}), $RUNS runs of: ${paths[*]} ${args[*]:-}" >&2

for run in $(seq "$RUNS"); do
  start=$(date +%s)
  set +e
  "$PYTHON" -m pytest -q -p no:cacheprovider "${paths[@]}" "${args[@]}"
  rc=$?
  set -e
  echo "hog: run $run of $RUNS: exit $rc in $(( $(date +%s) - start )) s" >&2
  if [ "$rc" -ne 0 ]; then
    exit "$rc"
  fi
done
echo "hog: $RUNS runs in a row passed" >&2
