#!/usr/bin/env bash
# The long variant of the fault suite and the fuzzers (not part of CI):
# 3-5x the traffic, repeated kills, 10x the hypothesis examples, more live fuzz
# rounds. Writes every FAULT line as JSON to ${KVB_FAULT_REPORT:-/tmp/kvb-soak-faults.jsonl}.
#   scripts/soak.sh                 # everything, ~10-15 minutes on 2 cores
#   scripts/soak.sh -k nats_kill    # extra pytest arguments narrow it down
set -euo pipefail
cd "$(dirname "$0")/.."
export KVB_SOAK=1
export KVB_FUZZ_EXAMPLES="${KVB_FUZZ_EXAMPLES:-2000}"
export KVB_FUZZ_LIVE_ROUNDS="${KVB_FUZZ_LIVE_ROUNDS:-2000}"
export KVB_FUZZ_SEED="${KVB_FUZZ_SEED:-$RANDOM}"
export KVB_FAULT_REPORT="${KVB_FAULT_REPORT:-${TMPDIR:-/tmp}/kvb-soak-faults.jsonl}"
echo "soak: seed $KVB_FUZZ_SEED, fault report $KVB_FAULT_REPORT" >&2
exec .venv/bin/python -m pytest tests/faults tests/fuzz -q -s -p no:cacheprovider -o timeout=1800 "$@"
