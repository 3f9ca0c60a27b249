#!/usr/bin/env bash
# The long SIGKILL soak (not in `make test`, which runs 36 kills):
#   tests/soak/sigkill_soak.sh [KILLS=1000] [BUILD=build-asan]
# SIGKILLs a saving process (tests/tools/crash_saver) KILLS times at random
# moments, cycling through whole, incremental and two-tier saves; after each,
# recovery must leave no debris in either tier, and the latest step of each
# must restore bit-exact and every step verify. Prints torn/lost counts; exit 0
# iff both are 0. The crash test is a doctest program, built in the sanitizer
# build (build/ has none: make test configures build-asan); about 1.3 s per
# kill there on the development VM (1,000 kills: 22 minutes).
set -euo pipefail
cd "$(dirname "$0")/../.."
KILLS=${1:-1000}
BUILD=${2:-build-asan}
if [ ! -f "$BUILD/build.ninja" ]; then
  echo "sigkill_soak: $BUILD is not configured; run 'make build-asan' (or 'make test') first" >&2
  exit 2
fi
ninja -C "$BUILD" tests/pipeline_crash_test tests/pipeline/crash_saver >/dev/null
CKPTIO_KILLS=$KILLS CKPTIO_CRASH_SAVER="$BUILD/tests/pipeline/crash_saver" \
  "$BUILD/tests/pipeline_crash_test" | grep -E "sigkill soak|remote tier|test cases|ERROR"
