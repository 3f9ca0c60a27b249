#!/usr/bin/env bash
# Quick end-to-end runs of ckptio-seed (bench/seed: the original experiment,
# reproduced) on the local disk and on the GCS emulator behind the shaping
# proxy (tests/gcs/with_gcs.py): each exits 0, prints the table with the
# four modes (ckptio-borrow: the double-buffered trainer whose saves borrow
# its state), leaves checkpoints that `ckptio verify` passes, writes a
# Chrome trace that python3's json module reads (with spans on the trainer,
# snapshot, write and commit tracks) and an SVG that is well-formed XML.
# No assertion on times: tests never assert on wall time.
#
#   tests/bench/seed_test.sh path/to/ckptio path/to/ckptio-seed
set -euo pipefail

CKPTIO=$(realpath "${1:?usage: seed_test.sh path/to/ckptio path/to/ckptio-seed}")
SEED=$(realpath "${2:?usage: seed_test.sh path/to/ckptio path/to/ckptio-seed}")
T=$(mktemp -d "${TMPDIR:-/tmp}/ckptio-seed-test.XXXXXX")
trap 'rm -rf "$T"' EXIT
unset CKPTIO_CONFIG
passed=0
failed=0
ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() { failed=$((failed + 1)); echo "FAIL $1"; }
check() { # check NAME COMMAND...
  local name=$1; shift
  if "$@"; then ok "$name"; else bad "$name"; fi
}

RC=0
"$SEED" --state-size 32MiB --saves 4 --compute 0.2s --dest "$T/dest" --out "$T/out" \
  >"$T/stdout" 2>"$T/stderr" || RC=$?
if [ "$RC" != 0 ]; then
  echo "ckptio-seed exited with $RC"; sed 's/^/  /' "$T/stdout" "$T/stderr" | tail -40
fi
check "ckptio-seed exits 0" test "$RC" = 0
check "no sanitizer report" bash -c "! grep -qE 'Sanitizer|runtime error:' '$T/stderr'"
for mode in blocking naive ckptio ckptio-borrow; do
  check "the table has a $mode row" grep -qE "^\| $mode \| [0-9.]+ s \|" "$T/stdout"
done
check "the table has its header" grep -qE '^\| mode \| total \| compute \| blocked in saves' "$T/stdout"
check "ckptio kept 3 good checkpoints" grep -qE '^\| ckptio \|.*\| 3/3 ok \|$' "$T/stdout"
check "blocking kept 3 good checkpoints" grep -qE '^\| blocking \|.*\| 3/3 ok \|$' "$T/stdout"
# The audit compares each kept checkpoint with the borrowed set as of its save.
check "ckptio-borrow kept 3 good checkpoints" grep -qE '^\| ckptio-borrow \|.*\| 3/3 ok \|$' "$T/stdout"
check "the target line names both ckptio modes" grep -qE \
  '^- target \(ckptio overhead <= 2%\): met by .*ckptio: .*ckptio-borrow: .*no copy' "$T/out/seed_local.md"
check "the report states the borrow run's memory: two sets of state" grep -qE \
  '^- memory held, trainer state \+ staging: .*ckptio-borrow 65\.0 MiB \(state 64\.0 MiB \+ staging_memory 1\.0 MiB\)' \
  "$T/out/seed_local.md"
check "the report is written" grep -qE '^\| ckptio \|' "$T/out/seed_local.md"
check "the naive threads are reported step by step" grep -qE '^\| 400 \|' "$T/out/seed_local.md"

check "the trace is JSON with spans on the trainer and snapshot tracks" python3 - "$T/out/seed_local_trace.json" <<'EOF'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
spans = {}
for e in events:
    if e.get("ph") == "X":
        spans.setdefault(names.get(e["tid"], "?"), []).append(e)
need = ["trainer (Save blocked)", "trainer: compute", "snapshot", "write / upload", "commit"]
missing = [t for t in need if len(spans.get(t, [])) == 0]
# Four timed saves (and two untimed warm-up saves) on the trainer track.
saves = [e for e in spans.get("trainer (Save blocked)", []) if e["name"] in ("Save(100)", "Save(200)", "Save(300)", "Save(400)")]
computes = [e for e in spans.get("trainer: compute", []) if e["name"] == "compute"]
if missing or len(saves) != 4 or len(computes) != 4:
    sys.exit(f"missing tracks {missing}; {len(saves)} timed Save spans, {len(computes)} compute spans")
# The compute before Save(N) ends at or before the save starts (the clocks are aligned).
first_save = min(e["ts"] for e in saves)
first_compute_end = min(e["ts"] + e["dur"] for e in computes)
if first_compute_end > first_save + 1000:
    sys.exit(f"compute ends at {first_compute_end} us, after the first save at {first_save} us")
EOF
check "the blocking run's trace is JSON too" python3 -c 'import json, sys; json.load(open(sys.argv[1]))' \
  "$T/out/seed_local_blocking_trace.json"
check "the ckptio-borrow trace has four timed saves and no snapshot copy" python3 - "$T/out/seed_local_borrow_trace.json" <<'EOF'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
spans = {}
for e in events:
    if e.get("ph") == "X":
        spans.setdefault(names.get(e["tid"], "?"), []).append(e)
saves = [e for e in spans.get("trainer (Save blocked)", []) if e["name"] in ("Save(100)", "Save(200)", "Save(300)", "Save(400)")]
if len(saves) != 4 or not spans.get("write / upload") or not spans.get("commit"):
    sys.exit(f"{len(saves)} timed Save spans; tracks {sorted(spans)}")
EOF
check "the SVG starts with <svg" bash -c "head -c 4 '$T/out/seed_local_timeline.svg' | grep -q '<svg'"
check "the SVG is well-formed XML" python3 -c 'import xml.dom.minidom as m, sys; m.parse(sys.argv[1])' \
  "$T/out/seed_local_timeline.svg"
check "the SVG has a panel per mode" bash -c \
  "grep -c 'class=\"panel\">\(blocking\|naive\|ckptio\|ckptio-borrow\) ' '$T/out/seed_local_timeline.svg' | grep -qx 4"
check "no raw manager trace is left behind" bash -c "! ls -A '$T/out' | grep -q raw"

# The ckptio and blocking runs left their 3 newest checkpoints (no --cleanup):
# the CLI lists them and re-reads every byte against its CRC32C.
for mode in ckptio ckptio-borrow blocking; do
  check "ckptio ls of the $mode run lists steps 200, 300, 400" bash -c \
    "'$CKPTIO' ls '$T/dest/$mode' | awk '{print \$2}' | tr '\n' ' ' | grep -qx '200 300 400 '"
  check "ckptio verify of the $mode run passes" bash -c \
    "'$CKPTIO' verify '$T/dest/$mode' >'$T/verify' && [ \$(grep -c ': OK,' '$T/verify') = 3 ]"
done
# The double-buffered trainer's compute writes the whole next state: every
# tensor differs between consecutive saves (a save that borrowed the wrong
# set, or a compute that left a tensor alone, would repeat a CRC32C).
check "every tensor of the ckptio-borrow run changed between consecutive saves" python3 - "$T/dest/ckptio-borrow" <<'EOF'
import json, sys
crcs = {s: [t["crc32c"] for t in json.load(open(f"{sys.argv[1]}/checkpoint_{s}/manifest.json"))["tensors"]]
        for s in (200, 300, 400)}
if len(crcs[200]) != 100:
    sys.exit(f"{len(crcs[200])} tensors, expected 100")
for a, b in ((200, 300), (300, 400)):
    same = sum(x == y for x, y in zip(crcs[a], crcs[b]))
    if same:
        sys.exit(f"{same} tensors have the same CRC32C in steps {a} and {b}")
EOF
check "the naive run wrote its files in checkpoint_<step> directories" test -d "$T/dest/naive/checkpoint_400"
check "the report states the memcpy limit" grep -qE '^- the limit: a warm memcpy on [0-9]+ threads ran at' \
  "$T/out/seed_local.md"

# --dir (the name `ckptio demo` uses) works as --dest; --cleanup removes what the runs wrote.
RC=0
"$SEED" --state-size 4MiB --saves 2 --compute 0.05s --keep 1 --modes ckptio,naive --dir "$T/dir" \
  --out "$T/out2" --cleanup >"$T/stdout2" 2>"$T/stderr2" || RC=$?
check "--dir works as --dest" test "$RC" = 0
check "with --keep 1 ckptio kept 1 good checkpoint" grep -qE '^\| ckptio \|.*\| 1/1 ok \|$' "$T/stdout2"
check "--cleanup leaves no checkpoint behind" bash -c "[ -z \"\$(find '$T/dir' -name 'checkpoint_*' 2>/dev/null)\" ]"
RC=0
"$SEED" --dir "$T/a" --dest "$T/b" >"$T/stdout" 2>"$T/stderr" || RC=$?
check "--dir and --dest together are a usage error" test "$RC" = 1

# The GCS emulator behind the shaping proxy, as bench/seed_experiment runs it.
WITH_GCS=$(cd "$(dirname "${BASH_SOURCE[0]}")/../gcs" && pwd)/with_gcs.py
RC=0
python3 "$WITH_GCS" --quiet -- bash -c '
  set -euo pipefail
  curl -sSf -XPOST "$CKPTIO_TEST_PROXY/__proxy/settings" -d "{\"latency_ms\": 20, \"bandwidth_bytes_per_s\": 200000000}" >/dev/null
  "$1" --state-size 8MiB --saves 4 --compute 0.1s --dest "gs://$CKPTIO_TEST_BUCKET/seed" --out "$2/gcs" >"$2/gcs.stdout"
  "$3" verify "gs://$CKPTIO_TEST_BUCKET/seed/ckptio" >"$2/gcs.verify"
  "$3" ls "gs://$CKPTIO_TEST_BUCKET/seed/ckptio" >"$2/gcs.ls"
  "$3" verify "gs://$CKPTIO_TEST_BUCKET/seed/ckptio-borrow" >"$2/gcs-borrow.verify"' \
  seed "$SEED" "$T" "$CKPTIO" >"$T/gcs.log" 2>&1 || RC=$?
if [ "$RC" != 0 ]; then
  echo "the GCS run exited with $RC"; sed 's/^/  /' "$T/gcs.log" | tail -40
fi
check "ckptio-seed on the GCS emulator exits 0" test "$RC" = 0
for mode in blocking naive ckptio ckptio-borrow; do
  check "the GCS table has a $mode row" grep -qE "^\| $mode \| [0-9.]+ s \|" "$T/gcs.stdout"
done
check "on GCS ckptio kept 3 good checkpoints" grep -qE '^\| ckptio \|.*\| 3/3 ok \|$' "$T/gcs.stdout"
check "ckptio verify of the GCS ckptio run passes" bash -c "[ \$(grep -c ': OK,' '$T/gcs.verify') = 3 ]"
check "on GCS ckptio-borrow kept 3 good checkpoints" grep -qE '^\| ckptio-borrow \|.*\| 3/3 ok \|$' "$T/gcs.stdout"
check "ckptio verify of the GCS ckptio-borrow run passes" bash -c \
  "[ \$(grep -c ': OK,' '$T/gcs-borrow.verify') = 3 ]"
check "the GCS borrow trace is JSON" python3 -c 'import json, sys; json.load(open(sys.argv[1]))' \
  "$T/gcs/seed_gcs_borrow_trace.json"
check "ckptio ls of the GCS ckptio run lists steps 200, 300, 400" bash -c \
  "awk '{print \$2}' '$T/gcs.ls' | tr '\n' ' ' | grep -qx '200 300 400 '"
check "the GCS trace has the trainer, snapshot and upload tracks" python3 - "$T/gcs/seed_gcs_trace.json" <<'EOF'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
names = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
tracks = {names.get(e["tid"]) for e in events if e.get("ph") == "X"}
need = {"trainer (Save blocked)", "trainer: compute", "snapshot", "write / upload", "commit"}
if not need <= tracks:
    sys.exit(f"missing tracks {sorted(need - tracks)}")
if any(e["ts"] < 0 for e in events if e.get("ph") == "X"):
    sys.exit("a span starts before the manager opened")
EOF
check "the GCS SVG is well-formed XML" python3 -c 'import xml.dom.minidom as m, sys; m.parse(sys.argv[1])' \
  "$T/gcs/seed_gcs_timeline.svg"

RC=0
"$SEED" --modes nosuch >"$T/stdout" 2>"$T/stderr" || RC=$?
check "an unknown mode is a usage error naming the modes there are" \
  bash -c "[ $RC = 1 ] && grep -q 'blocking, naive, ckptio and ckptio-borrow' '$T/stderr'"
RC=0
"$CKPTIO" bench seed >"$T/stdout" 2>"$T/stderr" || RC=$?
check "the shipped CLI has no bench command (it is bench/seed's ckptio-seed)" \
  bash -c "[ $RC = 1 ] && grep -q 'unknown command \"bench\"' '$T/stderr'"

echo "seed: $passed passed, $failed failed"
[ "$failed" = 0 ]
