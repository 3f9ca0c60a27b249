#!/usr/bin/env bash
# A minimal Debian 12 root for tests/wheel: debootstrap's minbase (dpkg, apt, coreutils, libc) with
# python3, python3-venv and ca-certificates (the trust store a user's machine has, which the
# wheel's libcurl must find) and nothing of the build's: no compiler, no pkg-config, no -dev
# package, no libcurl, libssl or liburing. One user, `user` (uid 1000), for whom the tests install
# and run the wheel. Made once into ROOT and reused while this script is unchanged (ROOT/.made-by
# holds its hash); the tests never write into it (they run on an overlay of it).
#
#   tests/wheel/make_root.sh ROOT        (root; apt-get install debootstrap; reaches deb.debian.org)
set -euo pipefail
root=$(realpath -m "${1:?usage: $0 ROOT}")
hash=$(sha256sum "$0" | cut -c1-16)
if [ -f "$root/.made-by" ] && [ "$(cat "$root/.made-by")" = "$hash" ]; then
  echo "make_root: $root is up to date"; exit 0
fi
start=$SECONDS
rm -rf "$root" "$root.tmp"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root.tmp" \
  http://deb.debian.org/debian > "$root.tmp.log" 2>&1 || { tail -n 30 "$root.tmp.log" >&2; exit 1; }
chroot "$root.tmp" useradd --create-home --uid 1000 --shell /bin/bash user
chroot "$root.tmp" apt-get clean
mv "$root.tmp.log" "$root.tmp/debootstrap.log"
echo "$hash" > "$root.tmp/.made-by"
mv "$root.tmp" "$root"
echo "make_root: $root made in $((SECONDS - start)) s ($(du -sm "$root" | cut -f1) MiB)" >&2
