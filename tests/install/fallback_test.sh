#!/usr/bin/env bash
# The dependency fallbacks of subprojects/: a copy of the source tree
# configured with --force-fallback-for=nlohmann_json,doctest fetches the two
# wraps' sources (GitHub, else Debian's archive, hash-checked by meson), and
# the manifest parser and its doctest test build against the subprojects'
# headers, not the system's, and pass.
#
#   tests/install/fallback_test.sh SOURCE_DIR
#
# Needs the network to deb.debian.org (or GitHub) once per run; the tree is
# copied so that the downloads never land in the source tree.
set -uo pipefail

SRC=$(realpath "${1:?usage: fallback_test.sh SOURCE_DIR}")
source "$(dirname "$0")/checks.sh" fallback

# The tree as git sees it (tracked files and new ones not ignored): no build dirs, no venv,
# no subprojects already fetched.
mkdir -p "$T/src"
(cd "$SRC" && { git ls-files -z --cached --others --exclude-standard 2>/dev/null || find . -path ./build\* -prune -o -path ./.venv\* -prune \
  -o -type f -print0; } | xargs -0 cp --parents -t "$T/src") || { bad "copy the source tree"; finish; }
rm -rf "$T/src/subprojects/json-3.11.2" "$T/src/subprojects/doctest-2.4.9" "$T/src/subprojects/packagecache"

check "meson setup --force-fallback-for=nlohmann_json,doctest" \
  meson setup "$T/build" "$T/src" --force-fallback-for=nlohmann_json,doctest -Dpython=disabled \
  -Dbench=disabled --buildtype=plain
# doctest's own meson.build overrides the dependency, so the log says "(overridden)" for it.
grep -E "Dependency nlohmann_json from subproject|Dependency doctest found: YES 2.4.9 \(overridden\)" \
  "$T/build/meson-logs/meson-log.txt" >"$T/found" 2>&1
check "both dependencies come from their subprojects" [ "$(grep -c . "$T/found")" = 2 ]

TARGETS=(tests/format_manifest_test)
check "the manifest test builds" ninja -C "$T/build" "${TARGETS[@]}"

# The headers the compiler actually read (ninja's record of its .d files): the subprojects' copies.
deps=$(ninja -C "$T/build" -t deps 2>/dev/null)
check "json.hpp came from the nlohmann_json subproject" \
  grep -qE "subprojects/json-3.11.2/.*nlohmann/json.hpp" <<<"$deps"
check "doctest.h came from the doctest subproject" grep -qE "subprojects/doctest-2.4.9/doctest/doctest.h" <<<"$deps"
check "no system copy of either was read" \
  bash -c 'd=$(cat); [ -n "$d" ] && ! grep -qE "/usr/include/(nlohmann/json\.hpp|doctest/doctest\.h)" <<<"$d"' \
  <<<"$deps"

for t in "${TARGETS[@]}"; do
  check "$(basename "$t") passes" "$T/build/$t"
done
finish
