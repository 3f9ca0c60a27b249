#!/usr/bin/env bash
# Multi-host commit latency vs process count, against the GCS emulator behind
# the shaping proxy of tests/gcs, which adds LATENCY_MS to every request (a
# remote bucket's round trip; the emulator on loopback answers in ~1 ms).
#   bench/multihost_bench.sh [BUILD=build] [MAX_PROCESSES=1024] [LATENCY_MS=10] [CONNECTIONS=16]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
MAX=${2:-1024}
LATENCY=${3:-10}
CONNECTIONS=${4:-16}
ninja -C "$BUILD" bench/multihost_bench >/dev/null
mkdir -p bench/results
python3 tests/gcs/with_gcs.py --quiet -- bash -c '
  curl -sf -XPOST "$CKPTIO_TEST_PROXY/__proxy/settings" -d "{\"latency_ms\": '"$LATENCY"'}" >/dev/null
  exec "$0" --max-processes "$1" --connections "$2" --latency-ms "$3"' \
  "$BUILD/bench/multihost_bench" "$MAX" "$CONNECTIONS" "$LATENCY" | tee bench/results/multihost.md
