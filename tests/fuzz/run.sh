#!/usr/bin/env bash
# Runs the fuzz targets built in BUILD (see README.md), all at once:
#   1. replay: every regression case in tests/fuzz/regressions/<target>/ and
#      every seed in tests/fuzz/corpus/<target>/, each once;
#   2. fuzz: for SECONDS from that seed corpus plus what earlier runs found
#      (BUILD/corpus/<target>/, where new inputs go).
# A crash, leak, sanitizer report, timeout or out-of-memory is a failure,
# reported with the input that caused it (a fuzzing find lands in
# BUILD/artifacts/<target>/). Logs: BUILD/logs/<target>-{replay,fuzz}.log.
#
#   tests/fuzz/run.sh [--build DIR] [--seconds N] [--junit FILE] [TARGET...]
#
# --junit writes one test case per target and step, for tests/tools/summarize.py.
# Exits non-zero if any step failed.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
build=build-fuzz
seconds=30
junit=""
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --junit) junit=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
[ ${#targets[@]} -eq 0 ] && targets=(fuzz_safetensors fuzz_manifest fuzz_config)
# A report left by an earlier run must not count for this one.
[ -n "$junit" ] && rm -f "$junit"

# Each input gets 10 s and 2 GiB (and no single allocation over 2 GiB): a
# parser that a small input drives into either has a bug to fix. Inputs up to
# 64 KiB leave room for deep nesting and long names.
common_flags=(-rss_limit_mb=2048 -malloc_limit_mb=2048 -timeout=10 -max_len=65536
              -print_final_stats=1)

mkdir -p "$build/logs"

# run_target TARGET: both steps for one target; writes $build/logs/TARGET.result
# as "replay_rc regressions seeds fuzz_rc execs execs_per_sec".
run_target() {
  local t=$1 bin="$build/$1" reg_rc=0 fuzz_rc=0
  local reg_log="$build/logs/$t-replay.log" fuzz_log="$build/logs/$t-fuzz.log"
  local regressions=() seeds=() f
  for f in "$here/regressions/$t"/*; do [ -f "$f" ] && regressions+=("$f"); done
  for f in "$here/corpus/$t"/*; do [ -f "$f" ] && seeds+=("$f"); done
  # Given files (not directories), libFuzzer runs each once and stops at the
  # first failure, after a "Running: FILE" line naming it.
  if [ $((${#regressions[@]} + ${#seeds[@]})) -gt 0 ]; then
    "$bin" "${common_flags[@]}" "${regressions[@]}" "${seeds[@]}" >"$reg_log" 2>&1 || reg_rc=$?
  else
    echo "nothing to replay" >"$reg_log"
  fi
  mkdir -p "$build/corpus/$t" "$build/artifacts/$t"
  "$bin" "${common_flags[@]}" -max_total_time="$seconds" -dict="$here/dict/$t.dict" \
    -artifact_prefix="$build/artifacts/$t/" \
    "$build/corpus/$t" "$here/corpus/$t" >"$fuzz_log" 2>&1 || fuzz_rc=$?
  local execs rate
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$fuzz_log" | tail -1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$fuzz_log" | tail -1)
  echo "$reg_rc ${#regressions[@]} ${#seeds[@]} $fuzz_rc ${execs:-0} ${rate:-0}" \
    >"$build/logs/$t.result"
}

for t in "${targets[@]}"; do
  if [ ! -x "$build/$t" ]; then
    echo "run.sh: $build/$t is not built (make build-fuzz)" >&2
    exit 2
  fi
done

echo "fuzzing ${targets[*]} for ${seconds}s each (logs in $build/logs/)"
pids=()
for t in "${targets[@]}"; do
  run_target "$t" &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done

xml_escape() { sed -e 's/&/\&amp;/g' -e 's/</\&lt;/g' -e 's/>/\&gt;/g' -e 's/"/\&quot;/g' |
               tr -cd '\11\12\15\40-\176'; }

failed=0
cases=""
for t in "${targets[@]}"; do
  read -r reg_rc nreg nseeds fuzz_rc execs rate <"$build/logs/$t.result"
  for step in replay fuzz; do
    log="$build/logs/$t-$step.log"
    if [ "$step" = replay ]; then
      rc=$reg_rc; what="$nreg regression case(s), $nseeds seed(s)"
      input=$(sed -n 's/^Running: //p' "$log" | tail -1)
    else
      rc=$fuzz_rc; what="${seconds}s, $execs runs, $rate exec/s"
      input=$(sed -n 's/.*Test unit written to //p' "$log" | tail -1)
    fi
    if [ "$rc" -eq 0 ]; then
      printf '  ok   %s %s: %s\n' "$t" "$step" "$what"
      cases+="<testcase classname=\"fuzz.$t\" name=\"$step\"/>"
    else
      failed=1
      printf '  FAIL %s %s: %s (exit %s); see %s\n' "$t" "$step" "$what" "$rc" "$log"
      printf '       input: %s\n' "${input:-unknown (see the log)}"
      grep -E 'ERROR: |SUMMARY: |invariant violated|^  ' "$log" | head -12 | sed 's/^/       /'
      message=$(printf 'exit %s, input %s' "$rc" "${input:-unknown}" | xml_escape)
      detail=$(tail -60 "$log" | xml_escape)
      cases+="<testcase classname=\"fuzz.$t\" name=\"$step\"><failure message=\"$message\">$detail</failure></testcase>"
    fi
  done
done

if [ -n "$junit" ]; then
  n=$((2 * ${#targets[@]}))
  nfail=$(grep -o '<failure ' <<<"$cases" | wc -l)
  printf '<?xml version="1.0" encoding="utf-8"?>\n<testsuites><testsuite name="fuzz" tests="%d" failures="%d" errors="0" skipped="0">%s</testsuite></testsuites>\n' \
    "$n" "$nfail" "$cases" >"$junit"
fi

if [ "$failed" -ne 0 ]; then
  cat <<EOF
A fuzz target failed. Reproduce with: $build/<target> $build/artifacts/<target>/<crash-file>
Once fixed, keep the input as a regression case: tests/fuzz/regressions/<target>/<what-it-was>.
EOF
fi
exit "$failed"
