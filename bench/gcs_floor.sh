#!/usr/bin/env bash
# The least one save can take on a GCS endpoint, measured with curl: the
# requests a save must make one after another, each group in parallel:
#   1. upload the shards (one request each, all at once)
#   2. write the manifest (the commit point)
#   3. delete the manifest of the checkpoint that falls out of keep, and list
#      its objects
#   4. delete its shards
# This is what the final wait of an asynchronous saver (the last save's
# write, commit and prune) cannot go below on that endpoint, whatever the
# client; ckptio's final wait is compared with it in the seed report.
#
#   bench/gcs_floor.sh ENDPOINT BUCKET TOTAL_BYTES SHARD_BYTES [ROUNDS]
#
# ENDPOINT is the JSON API root (http://127.0.0.1:PORT). Prints one line per
# timed round ("round N: total T s (upload U, manifest M, delete+list D,
# deletes X)") and a last line "median T" (seconds). Objects go under
# gcs-floor/ and are deleted at the end.
set -euo pipefail

ENDPOINT=$1
BUCKET=$2
TOTAL=$3
SHARD=$4
ROUNDS=${5:-3}

TMP=$(mktemp -d "${TMPDIR:-/tmp}/gcs-floor.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# Shards of SHARD bytes and the remainder, random (nothing compresses).
sizes=()
left=$TOTAL
while [ "$left" -gt 0 ]; do
  n=$((left < SHARD ? left : SHARD))
  sizes+=("$n")
  left=$((left - n))
done
for i in "${!sizes[@]}"; do
  head -c "${sizes[$i]}" /dev/urandom >"$TMP/shard-$i"
done
head -c 16000 /dev/urandom | base64 -w 0 >"$TMP/manifest"

now() { date +%s.%N; }
upload() {  # NAME FILE
  curl -sSf -o /dev/null -XPOST -H "Content-Type: application/octet-stream" --data-binary "@$2" \
    "$ENDPOINT/upload/storage/v1/b/$BUCKET/o?uploadType=media&name=$1"
}
delete() { curl -sSf -o /dev/null -XDELETE "$ENDPOINT/storage/v1/b/$BUCKET/o/$1"; }
urlname() { printf '%s' "$1" | sed 's|/|%2F|g'; }

# Writes checkpoint $1 (timing each phase) and prunes checkpoint $2 if given.
save() {
  local step=$1 old=${2:-} t0 t1 t2 t3 t4 pids=()
  t0=$(now)
  for i in "${!sizes[@]}"; do upload "gcs-floor%2F$step%2Fshard-$i" "$TMP/shard-$i" & pids+=($!); done
  for p in "${pids[@]}"; do wait "$p"; done
  t1=$(now)
  upload "gcs-floor%2F$step%2Fmanifest.json" "$TMP/manifest"
  t2=$(now)
  if [ -n "$old" ]; then
    pids=()
    delete "$(urlname "gcs-floor/$old/manifest.json")" & pids+=($!)
    curl -sSf -o /dev/null "$ENDPOINT/storage/v1/b/$BUCKET/o?prefix=gcs-floor%2F$old%2F" & pids+=($!)
    for p in "${pids[@]}"; do wait "$p"; done
    t3=$(now)
    pids=()
    for i in "${!sizes[@]}"; do delete "$(urlname "gcs-floor/$old/shard-$i")" & pids+=($!); done
    for p in "${pids[@]}"; do wait "$p"; done
  else
    t3=$t2
  fi
  t4=$(now)
  awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$t3" -v e="$t4" 'BEGIN {
    printf "total %.3f s (upload %.3f, manifest %.3f, delete+list %.3f, deletes %.3f)\n", e-a, b-a, c-b, d-c, e-d }'
}

save 0 >/dev/null  # the checkpoint the first timed round prunes
results=()
for r in $(seq 1 "$ROUNDS"); do
  line=$(save "$r" "$((r - 1))")
  echo "round $r: $line"
  results+=("$(echo "$line" | awk '{print $2}')")
done
# The last checkpoint, so nothing is left behind.
delete "$(urlname "gcs-floor/$ROUNDS/manifest.json")"
for i in "${!sizes[@]}"; do delete "$(urlname "gcs-floor/$ROUNDS/shard-$i")"; done
printf '%s\n' "${results[@]}" | sort -n | awk '{ v[NR] = $1 } END { printf "median %.3f\n", v[int((NR + 1) / 2)] }'
