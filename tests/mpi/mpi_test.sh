#!/usr/bin/env bash
# Multi-host checkpoints under Open MPI: 4 ranks save a sharded state with the
# MPI barrier (MPI_Ibarrier polled on ckptio's barrier thread) to the local
# disk and to the GCS emulator; it restores bit-exact on 4 and on 2 ranks.
#   mpi_test.sh WORKER_MPI WITH_GCS_PY
set -euo pipefail
WORKER=$1
WITH_GCS=$2
MPIRUN=(mpirun --oversubscribe --allow-run-as-root --mca btl self,vader --mca btl_vader_single_copy_mechanism none)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0
check() {  # check NAME CMD...
  local name=$1; shift
  if out=$("$@" 2>&1); then
    echo "ok   $name"; pass=$((pass + 1))
  else
    echo "FAIL $name"; echo "$out" | sed 's/^/     /'; fail=$((fail + 1))
  fi
}
restored_on() {  # restored_on N ROOT STEP: every rank says bit-exact
  local out
  out=$("${MPIRUN[@]}" -np "$1" "$WORKER" restore "$2" -1 -1 "$3" 4)
  echo "$out"
  [ "$(grep -c 'bit-exact' <<<"$out")" -eq "$1" ]
}

check "4 ranks save 2 steps to the local disk" "${MPIRUN[@]}" -np 4 "$WORKER" save "$TMP/local" -1 -1 1 2
check "the local checkpoint restores on 4 ranks" restored_on 4 "$TMP/local" 2
check "the local checkpoint restores on 2 ranks" restored_on 2 "$TMP/local" 2
check "one manifest, 12 tensors, shards of 4 ranks" bash -c \
  "python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); assert len(m[\"tensors\"])==12, m; assert {s[\"name\"][:12] for s in m[\"shards\"]}=={\"shard-p00000\",\"shard-p00001\",\"shard-p00002\",\"shard-p00003\"}' $TMP/local/checkpoint_2/manifest.json"

# Two tiers: a local tier per rank (TMP/pod/host<rank>), the remote tier a shared directory.
tiered_restore() {  # tiered_restore EXPECT_REMOTE_RANK: all bit-exact, only that rank (or none: -1) read remotely
  local out
  out=$("${MPIRUN[@]}" -np 4 "$WORKER" restore "$TMP/pod" -1 -1 3 4 --tiers "$TMP/pod-remote")
  echo "$out"
  [ "$(grep -c 'bit-exact' <<<"$out")" -eq 4 ] || return 1
  for r in 0 1 2 3; do
    if [ "$r" -eq "$1" ]; then
      grep -q "process $r restored .* (0 bytes from the remote tier)" <<<"$out" && return 1
    else
      grep -q "process $r restored .* (0 bytes from the remote tier)" <<<"$out" || return 1
    fi
  done
}
check "4 ranks save 3 incremental steps with two tiers (MPI all-gather)" \
  "${MPIRUN[@]}" -np 4 "$WORKER" save "$TMP/pod" -1 -1 1 3 --tiers "$TMP/pod-remote"
check "each rank's local tier has the steps, the remote tier one manifest per step naming every rank's files" bash -c "
  for r in 0 1 2 3; do cmp $TMP/pod/host0/checkpoint_3/manifest.json $TMP/pod/host\$r/checkpoint_3/manifest.json || exit 1; done
  python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); assert {s[\"name\"].split(\"/\")[-1][:12] for s in m[\"shards\"]}=={\"shard-p00000\",\"shard-p00001\",\"shard-p00002\",\"shard-p00003\"}, m' $TMP/pod-remote/checkpoint_3/manifest.json"
check "a restart restores on 4 ranks from the local tiers alone" tiered_restore -1
rm -rf "$TMP/pod/host2"
check "rank 2's local tier gone: it alone reads from the remote tier" tiered_restore 2

gcs_run() {
  python3 "$WITH_GCS" --quiet -- bash -c '
    set -e
    ROOT=gs://$CKPTIO_TEST_BUCKET/mpi
    '"${MPIRUN[*]}"' -np 4 '"$WORKER"' save "$ROOT" -1 -1 1 2
    out4=$('"${MPIRUN[*]}"' -np 4 '"$WORKER"' restore "$ROOT" -1 -1 2 4)
    out2=$('"${MPIRUN[*]}"' -np 2 '"$WORKER"' restore "$ROOT" -1 -1 2 4)
    echo "$out4"; echo "$out2"
    [ "$(grep -c bit-exact <<<"$out4")" -eq 4 ] && [ "$(grep -c bit-exact <<<"$out2")" -eq 2 ]'
}
check "4 ranks save to the GCS emulator; restores on 4 and 2 ranks" gcs_run

echo "[doctest] test cases: $((pass + fail)) | $pass passed | $fail failed | 0 skipped"
[ "$fail" -eq 0 ]
