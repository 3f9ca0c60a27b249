#!/usr/bin/env bash
# The C++ library as a user gets it: `meson install --destdir` of the build,
# then the README's C++ snippet, unchanged, built against that tree and run
#   1. with `pkg-config --cflags --libs ckptio` (the shared library),
#   2. the same, linked with the static library libckptio.a,
#   3. as a meson parent project with dependency('ckptio'),
# each saving three checkpoints and restoring the last bit-exact; and the
# symbols libckptio.so exports are the public API and nothing else.
#
#   tests/install/install_test.sh BUILD_DIR SOURCE_DIR
#
# Prints "ok"/"FAIL" per check and doctest's summary line for
# tests/tools/summarize.py.
set -uo pipefail

BUILD=$(realpath "${1:?usage: install_test.sh BUILD_DIR SOURCE_DIR}")
SRC=$(realpath "${2:?usage: install_test.sh BUILD_DIR SOURCE_DIR}")
source "$(dirname "$0")/checks.sh" install

DEST=$T/dest
check "meson install --destdir (devel tag: library, headers, ckptio.pc)" \
  meson install -C "$BUILD" --no-rebuild --destdir "$DEST" --tags devel
PC=$(find "$DEST" -name ckptio.pc | head -1)
LIB=$(dirname "$(find "$DEST" -name 'libckptio.so' | head -1)")
if [ -z "$PC" ] || [ -z "$LIB" ]; then
  bad "the install holds ckptio.pc and libckptio.so (found: pc='$PC' lib='$LIB')"
  finish
fi
export PKG_CONFIG_PATH=$(dirname "$PC") PKG_CONFIG_SYSROOT_DIR=$DEST
check "the public headers are installed, and only they" \
  bash -c "cd '$DEST' && ls \$(find . -path '*include/ckptio') | sort | tr '\n' ' ' | grep -qx 'barrier.h checkpoint_manager.h ckptio.h config.h dtype.h export.h options.h status.h tensor.h '"

# The snippet: its #include lines at the top of the harness, the rest in main().
python3 - "$SRC/README.md" "$SRC/tests/install/snippet_harness.cc.in" "$T/snippet.cc" <<'PY'
import re, sys
readme, harness, out = (open(sys.argv[1]).read(), open(sys.argv[2]).read(), sys.argv[3])
section = readme[readme.index("## Using it from C++"):]
code = re.search(r"```cpp\n(.*?)```", section, re.S).group(1)
includes = "\n".join(l for l in code.splitlines() if l.startswith("#include"))
body = "\n".join("  " + l if l else l for l in code.splitlines() if not l.startswith("#include"))
open(out, "w").write(harness.replace("@INCLUDES@", includes).replace("@BODY@", body))
PY
[ -s "$T/snippet.cc" ] && ok "the README's C++ snippet extracted" || bad "the README's C++ snippet extracted"

run_snippet() {  # run_snippet BINARY: in a fresh directory, with the installed library
  local dir; dir=$(mktemp -d "$T/run.XXXXXX")
  (cd "$dir" && LD_LIBRARY_PATH="$LIB" CKPTIO_CONFIG= "$1") && [ -f "$dir/checkpoints/checkpoint_300/manifest.json" ]
}
CXXFLAGS=(-std=c++20 -Wall -Wextra -Werror -O1)
check "pkg-config --cflags --libs ckptio builds the snippet" \
  bash -c "c++ ${CXXFLAGS[*]} '$T/snippet.cc' -o '$T/snippet-pc' \$(pkg-config --cflags --libs ckptio)"
check "that build runs: saves, then restores bit-exact" run_snippet "$T/snippet-pc"
# libckptio.a, with its own dependencies (Requires.private) linked as shared
# libraries: a fully static curl needs static builds of its own dependencies.
check "the snippet links the static library (libckptio.a + Requires.private)" \
  bash -c "c++ ${CXXFLAGS[*]} '$T/snippet.cc' -o '$T/snippet-static' \$(pkg-config --cflags ckptio) \
    -L'$LIB' -l:libckptio.a \$(pkg-config --libs \$(pkg-config --print-requires-private ckptio | cut -d' ' -f1)) -pthread"
check "the static build needs no libckptio.so" bash -c "! ldd '$T/snippet-static' | grep -q libckptio"
check "the static build runs: saves, then restores bit-exact" run_snippet "$T/snippet-static"

mkdir -p "$T/parent"
cp "$T/snippet.cc" "$T/parent/"
cat >"$T/parent/meson.build" <<'MESON'
project('trainer', 'cpp', default_options: ['cpp_std=c++20', 'warning_level=2', 'werror=true'])
executable('trainer', 'snippet.cc', dependencies: dependency('ckptio'))
MESON
check "a meson parent project finds dependency('ckptio')" meson setup "$T/parent/build" "$T/parent"
check "and builds the snippet" ninja -C "$T/parent/build"
check "that build runs: saves, then restores bit-exact" run_snippet "$T/parent/build/trainer"

# Every exported symbol is the C API or the C++ API the headers mark.
nm -D --defined-only -C "$LIB/libckptio.so" | sed -E 's/^[0-9a-f]+ [A-Za-z] //' | sort -u >"$T/exported"
grep -vE '^(ckptio_[a-z_]+|(typeinfo (name )?for |vtable for )?ckptio::(CheckpointManager|SaveHandle|Status|Barrier|BadResultAccess|CallbackBarrier|StatusCodeName|ErrnoToStatus|[A-Za-z]+Error|config::(LoadConfig|LoadConfigFile|ParseConfig|ValidateOptions))\b.*)$' \
  "$T/exported" >"$T/unexpected"
check "libckptio.so exports the public API only (unexpected: $(wc -l <"$T/unexpected"))" test ! -s "$T/unexpected"
[ -s "$T/unexpected" ] && head -20 "$T/unexpected"
for sym in 'ckptio::CheckpointManager::Open(' 'ckptio::CheckpointManager::Save(' 'ckptio::config::LoadConfig(' \
           'ckptio_open' 'ckptio_save' 'ckptio::Status::ToString'; do
  check "libckptio.so exports $sym" grep -qF "$sym" "$T/exported"
done
# (By name: a private member's parameters may name internal types.)
check "nothing internal is exported (pipeline, runtime, storage, gcs, http, format, base, nlohmann, std)" \
  bash -c "! sed 's/(.*//' '$T/exported' | grep -E 'ckptio::(pipeline|runtime|storage|gcs|http|format|base)::|nlohmann|^std::'"
finish
