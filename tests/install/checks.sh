# Sourced by the tests/install scripts: a temporary directory $T (removed at
# exit) and the checks. `check NAME CMD...` runs CMD with its output in
# $T/log, shown (last 30 lines) when it fails; `finish` prints the summary
# and doctest's summary line (for tests/tools/summarize.py) and exits.
#   source checks.sh SUITE_NAME
CHECKS_SUITE=$1
T=$(mktemp -d "${TMPDIR:-/tmp}/ckptio-$CHECKS_SUITE-test.XXXXXX")
trap 'rm -rf "$T"' EXIT
passed=0
failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; [ -f "$T/log" ] && sed 's/^/     /' "$T/log" | tail -30; }
check() { local name=$1; shift; if "$@" >"$T/log" 2>&1; then ok "$name"; else bad "$name"; fi; }
finish() {
  echo "$CHECKS_SUITE: $passed passed, $failed failed"
  echo "[doctest] test cases: $((passed + failed)) | $passed passed | $failed failed"
  [ "$failed" = 0 ]
  exit $?
}
