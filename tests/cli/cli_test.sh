#!/usr/bin/env bash
# End-to-end test of the ckptio CLI, run the way a user runs it: real
# checkpoints on the real file system, corrupted with dd, read back with
# python3's json module, compared with cmp.
#
#   tests/cli/cli_test.sh path/to/ckptio
#
# Every check prints "ok" or "FAIL" with what it saw; the script ends with
# "cli: N passed, M failed" and exits non-zero if anything failed.
set -euo pipefail

CKPTIO=$(realpath "${1:?usage: cli_test.sh path/to/ckptio}")
T=$(mktemp -d "${TMPDIR:-/tmp}/ckptio-cli-test.XXXXXX")
passed=0
failed=0
finished=0
on_exit() {
  local rc=$?
  # set -e stopped the script in a setup step (not in a check): say so.
  if [ "$finished" = 0 ]; then
    echo "cli: aborted (exit status $rc) after $passed passed, $failed failed"
    echo "[doctest] test cases: $((passed + failed + 1)) | $passed passed | $((failed + 1)) failed"
  fi
  rm -rf "$T"
}
trap on_exit EXIT
unset CKPTIO_CONFIG
cd "$T"

RC=0

ok() { passed=$((passed + 1)); echo "ok   $1"; }
bad() {
  failed=$((failed + 1))
  echo "FAIL $1"
  # The output of the last run, which is what most checks look at.
  echo "     last run: exit status $RC; stdout:"; sed 's/^/       /' "$T/out" 2>/dev/null | head -20 || true
  echo "     stderr:"; sed 's/^/       /' "$T/err" 2>/dev/null | head -20 || true
}
check() { # check NAME COMMAND...: passes if COMMAND succeeds
  local name=$1; shift
  if "$@"; then ok "$name"; else bad "$name"; fi
}

# run ARGS...: runs ckptio, stdout in $T/out, stderr in $T/err, status in $RC.
# A sanitizer report fails the run whatever its exit status (ASan exits 1,
# which some checks expect for other reasons).
run() {
  RC=0
  "$CKPTIO" "$@" >"$T/out" 2>"$T/err" || RC=$?
  if grep -qE 'Sanitizer|runtime error:' "$T/err"; then bad "no sanitizer report from: ckptio $*"; fi
}
rc_is() { [[ $RC == "$1" ]]; }
out_has() { grep -qE -- "$1" "$T/out"; }
err_has() { grep -qE -- "$1" "$T/err"; }
lines_of() { grep -cE -- "$2" "$1" || true; }
# No carriage return, no escape character: a non-terminal gets no progress bar.
err_plain() { ! grep -q $'\r' "$T/err" && ! grep -q $'\e' "$T/err"; }

# py SCRIPT ARGS...: small checks of file contents with python3's stdlib.
py() { python3 -c "$@"; }

# The tensor data of shard 0 of a checkpoint: prints "SHARD_PATH OFFSET NAME"
# for a byte in the middle of the first non-empty tensor.
FIND_TENSOR_BYTE='
import json, sys
ckpt = sys.argv[1]
m = json.load(open(ckpt + "/manifest.json"))
t = next(t for t in m["tensors"] if t["bytes"] > 0)
print(ckpt + "/" + t["shard"], t["offset"] + t["bytes"] // 2, t["name"])
'

# Checks FILE is a well-formed safetensors file as the spec says: header
# padded to a multiple of 8, tensors contiguous from 0 in header order, no
# bytes after the last one. Prints "<tensor count> <metadata as JSON>".
CHECK_SAFETENSORS='
import json, struct, sys
data = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", data[:8])[0]
assert (8 + n) % 8 == 0, "header not padded to 8: %d" % n
h = json.loads(data[8:8 + n])
meta = h.pop("__metadata__", {})
pos = 0
for name, t in h.items():
    b, e = t["data_offsets"]
    assert b == pos, "%s starts at %d, expected %d" % (name, b, pos)
    pos = e
assert 8 + n + pos == len(data), "file has %d bytes, header says %d" % (len(data), 8 + n + pos)
print(len(h), json.dumps(meta, sort_keys=True))
'

# The data section of a safetensors file (everything after the header).
data_section() { py 'import struct,sys; d=open(sys.argv[1],"rb").read(); n=struct.unpack("<Q",d[:8])[0]; sys.stdout.buffer.write(d[8+n:])' "$1"; }

flip_byte() { # flip_byte FILE OFFSET: inverts one byte in place
  local v
  v=$(od -An -tu1 -j "$2" -N1 "$1" | tr -d ' ')
  printf "\\$(printf %03o $((v ^ 0xff)))" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

echo "== demo"
run demo --state-size 64MiB --saves 3 --compute 0.2s --dir D
check "demo exits 0" rc_is 0
check "demo prints the table header" out_has 'total +compute +blocked in saves +overhead +checkpoint bytes/s +speedup'
check "demo prints the blocking row" out_has '^blocking +[0-9.]+ s +[0-9.]+ s +[0-9.]+ s +-?[0-9.]+% +[0-9.]+ [KMG]iB/s +1\.00x'
check "demo prints the ckptio row" out_has '^ckptio +[0-9.]+ s +[0-9.]+ s +[0-9.]+ s +-?[0-9.]+% +[0-9.]+ [KMG]iB/s +[0-9.]+x'
check "demo shows ls of DIR/async" out_has '^step 300 .* 64\.0 MiB +1 shard +100 tensors'
check "demo shows verify of DIR/async" out_has '^step 300: OK, 64\.0 MiB in'
check "demo stderr has no progress bar when not a terminal" err_plain
check "demo wrote the blocking run too" test -f D/blocking/checkpoint_300/manifest.json

echo "== ls"
run ls D/async
check "ls exits 0" rc_is 0
check "ls lists 3 steps" [ "$(lines_of "$T/out" '^step ')" = 3 ]
check "ls lists steps 100, 200, 300 in order" [ "$(awk '{print $2}' "$T/out" | tr '\n' ' ')" = "100 200 300 " ]
check "ls shows bytes, shards and tensors" out_has '^step 100 +[0-9T:-]+Z +64\.0 MiB +1 shard +100 tensors$'
mkdir E
run ls E
check "ls of an empty root exits 0 and prints nothing on stdout" eval 'rc_is 0 && [ ! -s "$T/out" ]'
run ls nonexistent
check "ls of a missing root exits 1" rc_is 1
check "ls of a missing root names it" err_has '^ckptio: .*nonexistent.*does not exist'
check "ls does not create a missing root" test ! -e nonexistent

echo "== verify"
run verify D/async
check "verify exits 0" rc_is 0
check "verify prints one OK line per step" [ "$(lines_of "$T/out" '^step [0-9]+: OK, 64\.0 MiB in [0-9.]+ s$')" = 3 ]
check "verify prints no progress bar when not a terminal" err_plain
run verify D/async --step 200
check "verify --step checks only that step" eval 'rc_is 0 && [ "$(cat "$T/out" | grep -c OK)" = 1 ] && out_has "^step 200: OK"'
run verify D/async --step 12345
check "verify of a step that does not exist exits 1" eval 'rc_is 1 && err_has "step 12345"'

cp -a D/async C
read -r shard offset tensor < <(py "$FIND_TENSOR_BYTE" C/checkpoint_300)
check "the flipped byte lies past the 4096-byte header region" [ "$offset" -gt 4096 ]
flip_byte "$shard" "$offset"
run verify C
check "verify of a flipped byte exits 2" rc_is 2
check "verify names the corrupt shard" err_has "checkpoint_300/shard-00000\.safetensors"
check "verify names the corrupt tensor" err_has "tensor \"$tensor\""
check "verify says it is a CRC32C mismatch" err_has 'CRC32C mismatch'
check "verify still reports the intact steps" eval 'out_has "^step 100: OK" && out_has "^step 200: OK"'
run export C --step 300 --out corrupt.safetensors
check "export of a corrupt step exits 2 and writes nothing" eval 'rc_is 2 && [ ! -e corrupt.safetensors ] && [ ! -e corrupt.safetensors.tmp ]'

cp -a D/async Tr
truncate -s -1000 Tr/checkpoint_200/shard-00000.safetensors
run verify Tr --step 200
check "verify of a truncated shard exits 2" rc_is 2
check "verify of a truncated shard says so" err_has 'checkpoint_200/shard-00000\.safetensors.*truncated'

echo "== export / save"
run export D/async --out e1.safetensors
check "export exits 0" rc_is 0
check "export (latest by default) reports step 300" out_has '^exported step 300 to e1\.safetensors: 100 tensors'
check "export writes no progress bar when not a terminal" err_plain
check "export leaves no tmp file" test ! -e e1.safetensors.tmp
check "export writes a valid safetensors file with 100 tensors and the metadata" \
  [ "$(py "$CHECK_SAFETENSORS" e1.safetensors)" = '100 {"demo": "async", "step": "300"}' ]
data_section D/async/checkpoint_300/shard-00000.safetensors >shard.data
data_section e1.safetensors >e1.data
check "exported tensor bytes equal the checkpoint's" cmp -s shard.data e1.data

run save R2 --step 1 --from e1.safetensors
check "save of the export exits 0" rc_is 0
check "save reports step, tensors and bytes, and the root's absolute path" \
  out_has "^saved step 1 to $T/R2: 100 tensors from 1 files, 64\\.[01] MiB in"
check "save prints no progress bar when not a terminal" err_plain
run verify R2
check "the imported checkpoint verifies" eval 'rc_is 0 && out_has "^step 1: OK"'
run export R2 --step 1 --out e2.safetensors
check "export of the imported checkpoint exits 0" rc_is 0
check "export -> save -> export is byte-identical" cmp e1.safetensors e2.safetensors
run save R2 --step 1 --from e1.safetensors
check "save of an existing step exits 1" eval 'rc_is 1 && err_has "step 1 already exists"'

# Two inputs: tensors split across files must land in one checkpoint.
py '
import json, struct
def write(path, tensors):
    header, data = {}, b""
    for name, raw in tensors:
        header[name] = {"dtype": "U8", "shape": [len(raw)], "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + data)
write("a.safetensors", [("a/x", b"hello"), ("a/y", b"world!")])
write("b.safetensors", [("b/z", bytes(range(256)))])
write("dup.safetensors", [("a/y", b"other")])
'
run save R4 --step 7 --from a.safetensors --from b.safetensors --metadata '{"run":"two-files"}'
check "save of two files exits 0" eval 'rc_is 0 && out_has "3 tensors from 2 files"'
run export R4 --out r4.safetensors
check "both files' tensors are in the checkpoint, in order, with the metadata" \
  [ "$(py "$CHECK_SAFETENSORS" r4.safetensors)" = '3 {"run": "two-files"}' ]
check "their bytes round-trip" [ "$(data_section r4.safetensors | head -c 11)" = "helloworld!" ]
py '
import json, struct
def write(path, name, meta):
    header = {"__metadata__": meta, name: {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}}
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    open(path, "wb").write(struct.pack("<Q", len(h)) + h + b"abc")
write("m1.safetensors", "m/one", {"source": "first"})
write("m2.safetensors", "m/two", {"source": "second"})
'
run save RM --step 1 --from m1.safetensors --from m2.safetensors
check "inputs whose __metadata__ differ need --metadata (exit 1, saying so)" eval 'rc_is 1 && err_has "pass --metadata"'
run save RM --step 1 --from m1.safetensors --from m2.safetensors --metadata '{"source":"both"}'
check "with --metadata they save" eval 'rc_is 0 && out_has "2 tensors from 2 files"'
run export RM --out rm.safetensors
check "and the checkpoint holds the --metadata given" [ "$(py "$CHECK_SAFETENSORS" rm.safetensors)" = '2 {"source": "both"}' ]
run save R5 --step 1 --from a.safetensors --from dup.safetensors
check "save with a tensor name in two files exits 1" rc_is 1
check "the error names the tensor and both files" err_has 'tensor "a/y" is in both a\.safetensors and dup\.safetensors'
echo "this is not a safetensors file" >junk.safetensors
run save R5 --step 1 --from junk.safetensors
check "save of a malformed file exits 1 and names it" eval 'rc_is 1 && err_has "^ckptio: invalid safetensors input: junk\.safetensors"'
: >empty.safetensors
run save R5 --step 1 --from empty.safetensors
check "save of an empty file exits 1 and names it" eval 'rc_is 1 && err_has "empty\.safetensors"'
run save R5 --step 1 --from missing.safetensors
check "save of a missing file exits 1 and names it" eval 'rc_is 1 && err_has "missing\.safetensors"'
check "failed saves committed nothing" eval '[ ! -d R5 ] || [ -z "$(ls R5)" ]'
run save R5 --step 1 --from a.safetensors --metadata '[1,2]'
check "save with non-object metadata exits 1" eval 'rc_is 1 && err_has "metadata must be a JSON object"'

echo "== roots that look like URLs"
for root in gcs://b/run s3://b/run gs:/b/run gs:// gs://UPPER/run; do
  run save "$root" --step 1 --from a.safetensors
  check "save to $root exits 1 and names the accepted forms" \
    eval 'rc_is 1 && err_has "bad checkpoint root \"$root\".*gs://BUCKET\[/PREFIX\]"'
  run ls "$root"
  check "ls of $root exits 1" eval 'rc_is 1 && err_has "bad checkpoint root"'
done
check "no save to a URL-like root wrote anything" eval '[ ! -e gcs: ] && [ ! -e s3: ] && [ ! -e gs: ]'
run save ./gcs:/b/run --step 1 --from a.safetensors
check "./gcs:/b/run is a local directory" eval 'rc_is 0 && [ -f "gcs:/b/run/checkpoint_1/manifest.json" ]'

echo "== what sits where a file should be"
cp -a D/async H
rm H/checkpoint_300/manifest.json
mkfifo H/checkpoint_300/manifest.json
for cmd in ls verify; do
  RC=0; timeout 60 "$CKPTIO" $cmd H >"$T/out" 2>"$T/err" || RC=$?
  check "$cmd with a FIFO as a manifest exits 2 at once (no hang) naming it by its absolute path" \
    eval 'rc_is 2 && err_has "$T/H/checkpoint_300/manifest.json: a FIFO where a checkpoint file should be"'
done
RC=0; timeout 60 "$CKPTIO" export H --step 300 --out h.safetensors >"$T/out" 2>"$T/err" || RC=$?
check "export of it exits 2 at once" eval 'rc_is 2 && err_has "a FIFO"'
rm H/checkpoint_300/manifest.json
ln -s /etc/passwd H/checkpoint_300/manifest.json
run verify H --step 300
check "verify of a manifest linked out of the root exits 2 without quoting the target" \
  eval 'rc_is 2 && err_has "manifest.json: a symbolic link" && ! err_has "root:"'
rm H/checkpoint_300/manifest.json
mkdir H/checkpoint_300/manifest.json
run verify H --step 300
check "a directory where manifest.json should be is an integrity failure (2)" eval 'rc_is 2 && err_has "a directory where"'
rm H/checkpoint_200/shard-00000.safetensors
run verify H --step 200
check "a missing shard is an integrity failure (2), named by its absolute path" \
  eval 'rc_is 2 && err_has "$T/H/checkpoint_200/shard-00000\.safetensors"'
mkfifo fifo.safetensors
RC=0; timeout 60 "$CKPTIO" save F1 --step 1 --from fifo.safetensors >"$T/out" 2>"$T/err" || RC=$?
check "save --from a FIFO exits 1 at once" eval 'rc_is 1 && err_has "fifo\.safetensors is not a regular file"'
mkdir E2
run verify E2
check "verify of a root without a committed checkpoint exits 1 and says so" \
  eval 'rc_is 1 && err_has "no committed checkpoint in $T/E2: nothing to verify"'
cp -a D/async P
chmod 000 P/checkpoint_200
if command -v setpriv >/dev/null && [ "$(id -u)" = 0 ]; then
  # root passes every permission check: drop the capabilities that let it.
  AS_USER=(setpriv --inh-caps=-dac_override,-dac_read_search --bounding-set=-dac_override,-dac_read_search)
else
  AS_USER=()
fi
RC=0; "${AS_USER[@]}" "$CKPTIO" ls P >"$T/out" 2>"$T/err" || RC=$?
check "ls of a root with a step directory it cannot search exits 2 naming it (not silently skipped)" \
  eval 'rc_is 2 && err_has "cannot look into $T/P/checkpoint_200: Permission denied"'
chmod 755 P/checkpoint_200
run export D/async --out D/async/checkpoint_300/manifest.json
check "export --out inside the checkpoint root exits 1 and writes nothing" \
  eval 'rc_is 1 && err_has "is inside the checkpoint root" && cmp -s D/async/checkpoint_300/manifest.json P/checkpoint_300/manifest.json'
run export D/async --out D/async/x.safetensors
check "export --out anywhere under the root is refused too" eval 'rc_is 1 && [ ! -e D/async/x.safetensors ]'

echo "== usage errors"
run
check "no command exits 1 and prints the usage" eval 'rc_is 1 && err_has "^usage: ckptio"'
run frobnicate
check "an unknown command exits 1" eval 'rc_is 1 && err_has "^ckptio: unknown command \"frobnicate\""'
run ls D/async --bogus
check "an unknown flag exits 1 and names it" eval 'rc_is 1 && err_has "^ckptio: ls: unknown flag --bogus"'
run verify
check "a missing positional exits 1 and names it" eval 'rc_is 1 && err_has "^ckptio: verify: missing ROOT"'
run verify D/async --step
check "a flag without its value exits 1" eval 'rc_is 1 && err_has "--step needs a value"'
run verify D/async --step abc
check "a non-numeric --step exits 1" eval 'rc_is 1 && err_has "--step: expected an integer"'
run export D/async
check "export without --out exits 1" eval 'rc_is 1 && err_has "--out FILE is required"'
run save R6 --step 1
check "save without --from exits 1" eval 'rc_is 1 && err_has "--from FILE is required"'
run save R6 --from a.safetensors
check "save without --step exits 1" eval 'rc_is 1 && err_has "--step N is required"'
run demo --state-size 12XB
check "a bad size exits 1 and quotes it" eval 'rc_is 1 && err_has "state-size.*12XB"'
run demo --compute forever
check "a bad duration exits 1" eval 'rc_is 1 && err_has "compute.*forever"'
run ls D/async extra
check "an extra positional exits 1" eval 'rc_is 1 && err_has "unexpected argument \"extra\""'
for cmd in demo save ls verify export rm prune config; do
  run "$cmd" --help
  check "$cmd --help exits 0 with a usage line" eval 'rc_is 0 && out_has "^usage: ckptio $cmd"'
done
run --help
check "--help lists every subcommand" eval 'rc_is 0 && [ "$(grep -cE "^  (demo|save|ls|verify|export|rm|prune|config|help) " "$T/out")" = 9 ]'
run help verify
check "help COMMAND shows that command" eval 'rc_is 0 && out_has "^usage: ckptio verify ROOT"'
run --version
check "--version prints the version" eval 'rc_is 0 && out_has "^ckptio [0-9]+\.[0-9]+\.[0-9]+$"'
check "--version names libcurl, its protocols and the CA certificates https trusts" \
  eval 'out_has "^libcurl/[0-9.]+ .*OpenSSL/3.*; protocols: .*https.*; CA: /"'

echo "== config"
run config defaults
check "config defaults exits 0" rc_is 0
cp "$T/out" defaults.json
check "config defaults lists the knobs" grep -q staging_memory defaults.json
run --config defaults.json config show
check "config defaults fed back as --config works (config show exits 0)" rc_is 0
cp "$T/out" shown.json
run config show
check "the defaults file yields the default config" cmp -s shown.json "$T/out"
run ls D/async --config defaults.json
check "ls accepts the defaults file as --config" eval 'rc_is 0 && [ "$(lines_of "$T/out" "^step ")" = 3 ]'
echo '{"stagin_memory": "1GiB"}' >typo.json
run ls D/async --config typo.json
check "a config with an unknown key exits 1" rc_is 1
check "the error names the key and the file" err_has 'typo\.json.*"stagin_memory"'
RC=0; CKPTIO_CONFIG=typo.json "$CKPTIO" config show >"$T/out" 2>"$T/err" || RC=$?
check "CKPTIO_CONFIG is honoured" eval 'rc_is 1 && err_has "typo\.json"'
run config show --config does-not-exist.json
check "a missing config file exits 1 and names it" eval 'rc_is 1 && err_has "does-not-exist\.json"'
echo '{"prefix": "ckpt_"}' >prefix.json
run --config prefix.json save R7 --step 5 --from a.safetensors
check "save honours the config (prefix)" eval 'rc_is 0 && [ -f R7/ckpt_5/manifest.json ]'
run ls R7
check "ls without that config does not see the step" eval 'rc_is 0 && [ ! -s "$T/out" ]'
run ls R7 --config prefix.json
check "ls with that config sees it" eval 'rc_is 0 && out_has "^step 5 "'
run config nonsense
check "config with an unknown action exits 1" rc_is 1

echo "== rm / prune"
cp -a D/async M
run rm M --step 100
check "rm exits 0" eval 'rc_is 0 && out_has "^deleted step 100$"'
run ls M
check "ls after rm lists the other 2 steps" [ "$(awk '{print $2}' "$T/out" | tr '\n' ' ')" = "200 300 " ]
run rm M --step 100
check "rm of a step that is gone exits 1" eval 'rc_is 1 && err_has "step 100"'
run rm M
check "rm without --step exits 1" eval 'rc_is 1 && err_has "rm: --step N is required"'
run save M --step 400 --from a.safetensors
run save M --step 500 --from a.safetensors
run ls M
check "save does not prune (4 steps after two imports)" [ "$(lines_of "$T/out" '^step ')" = 4 ]
run prune M --keep 1
check "prune exits 0" rc_is 0
check "prune prints what it deleted" [ "$(grep '^deleted step' "$T/out" | awk '{print $3}' | tr '\n' ' ')" = "200 300 400 " ]
run ls M
check "ls after prune lists only the newest" [ "$(awk '{print $2}' "$T/out" | tr '\n' ' ')" = "500 " ]
run prune M --keep 1
check "prune with nothing to do says so" eval 'rc_is 0 && out_has "^nothing to prune"'
run prune M
check "prune without --keep exits 1" eval 'rc_is 1 && err_has "prune: --keep K is required"'
run rm nonexistent --step 1
check "rm in a missing root exits 1" rc_is 1

echo "== two tiers"
echo '{"tiers": {"remote": "TR", "remote_keep": 1}}' > tiers.json
run --config tiers.json save TL --step 1 --from a.safetensors
run --config tiers.json save TL --step 2 --from a.safetensors
check "save with two tiers returns once the step is in the remote tier" eval 'rc_is 0 && out_has "^copying step 2 to the remote tier TR" && [ -f TR/checkpoint_2/manifest.json ]'
check "save with two tiers keeps every step in both tiers (no keep policy on import)" [ -f TR/checkpoint_1/manifest.json ]
run --config tiers.json ls TL
check "ls shows each step's tiers" eval 'out_has "^step 1 .*\[local, remote\]" && out_has "^step 2 .*\[local, remote\]"'
run --config tiers.json ls TL-missing
check "ls of a missing local tier points at the remote one" eval 'rc_is 1 && err_has "TL-missing does not exist \(its remote tier is TR"'

echo "== terminal"
if command -v script >/dev/null; then
  # script(1) runs the command on a pseudo-terminal: the progress bar shows.
  script -qec "'$CKPTIO' verify D/async --step 300" /dev/null >tty.txt 2>&1 || true
  check "on a terminal verify draws a progress bar" grep -q $'\e\[K' tty.txt
  check "on a terminal verify still prints its result" grep -q 'step 300: OK' tty.txt
else
  echo "skip terminal checks: script(1) not installed"
fi

finished=1
echo
echo "cli: $passed passed, $failed failed"
# The same counts in doctest's format, so tests/tools/summarize.py counts
# each check of this script rather than the script as one case.
echo "[doctest] test cases: $((passed + failed)) | $passed passed | $failed failed"
[ "$failed" = 0 ]
