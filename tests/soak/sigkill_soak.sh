#!/usr/bin/env bash
# The long SIGKILL soak (not in `make test`, which runs 36 kills):
#   tests/soak/sigkill_soak.sh [KILLS=1000] [BUILD=build]
# SIGKILLs a saving process (tests/tools/crash_saver) KILLS times at random
# moments; after each, recovery must leave no debris, and the latest step must
# restore bit-exact and every step verify. Prints torn/lost counts; exit 0 iff
# both are 0. About 0.5 s per kill on the development VM.
set -euo pipefail
cd "$(dirname "$0")/../.."
KILLS=${1:-1000}
BUILD=${2:-build}
ninja -C "$BUILD" tests/pipeline_crash_test tests/pipeline/crash_saver >/dev/null
CKPTIO_KILLS=$KILLS CKPTIO_CRASH_SAVER="$BUILD/tests/pipeline/crash_saver" \
  "$BUILD/tests/pipeline_crash_test" | grep -E "sigkill soak|test cases|ERROR"
