#!/usr/bin/env bash
# Builds the ckptio wheel for PyPI, DIR/wheelhouse/ckptio-<version>-cp3XY-cp3XY-manylinux_2_31_x86_64.whl,
# and the sdist, DIR/sdist/ckptio-<version>.tar.gz.
#
#   packaging/build-wheel.sh [--dir build-wheel] [--python python3]
#
# 1. the tools (packaging/requirements.txt) in DIR/venv-cp3XY, made with the given Python: the
#    wheel is for that Python (CPython 3.11 here; one run per Python version for others)
# 2. the sysroot and static libraries (packaging/build-deps.sh, cached in DIR/deps)
# 3. meson-python builds the wheel (python -m build --no-isolation) with DIR/deps/native.ini, in
#    DIR/meson-cp3XY (kept: a rebuild compiles what changed). A unity build (each layer one
#    translation unit), as the sanitizer builds are: it compiles the standard and nlohmann
#    headers once per layer instead of once per file.
# 4. auditwheel repair checks it against the manylinux_2_31 policy (it fails if a symbol needs a
#    newer glibc, or a library outside that policy is linked), strips it and sets its tag.
# Compiles at nice 10. Prints the wheel's path last.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=build-wheel python=python3 plat=manylinux_2_31_x86_64
while [ $# -gt 0 ]; do
  case $1 in
    --dir) dir=$2; shift 2 ;;
    --python) python=$2; shift 2 ;;
    *) echo "usage: $0 [--dir DIR] [--python PYTHON]" >&2; exit 2 ;;
  esac
done
dir=$(realpath -m "$dir")
tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
venv=$dir/venv-$tag
start=$SECONDS
say() { echo "build-wheel: $* ($((SECONDS - start)) s)" >&2; }

if [ ! -f "$venv/.installed" ] || [ packaging/requirements.txt -nt "$venv/.installed" ]; then
  say "tools into $venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r packaging/requirements.txt
  touch "$venv/.installed"
fi
packaging/build-deps.sh "$dir/deps"
deps=$dir/deps

say "meson-python ($tag)"
rm -rf "$dir/dist-$tag" && mkdir -p "$dir/dist-$tag" "$dir/wheelhouse"
# PATH: meson and ninja of the tools' venv.
PATH="$venv/bin:$PATH" nice -n 10 "$venv/bin/python" -m build --wheel --no-isolation --outdir "$dir/dist-$tag" \
  -Cbuild-dir="$dir/meson-$tag" \
  -Csetup-args=--native-file="$deps/native.ini" \
  -Csetup-args=-Dbench=disabled \
  -Csetup-args=-Dunity=on -Csetup-args=-Dunity_size=100 \
  -Csetup-args=-Dbundled_licenses="$deps/licenses" > "$dir/build-$tag.log" 2>&1 \
  || { grep -E "error|Error|ERROR" "$dir/build-$tag.log" | head -n 30 >&2; echo "build-wheel: log: $dir/build-$tag.log" >&2; exit 1; }
raw=$(ls "$dir/dist-$tag"/ckptio-*.whl)

say "auditwheel repair --plat $plat"
rm -f "$dir/wheelhouse"/ckptio-*-"$tag"-"$tag"-*.whl
PATH="$venv/bin:$PATH" "$venv/bin/auditwheel" repair --plat "$plat" --only-plat --strip -w "$dir/wheelhouse" "$raw" \
  > "$dir/auditwheel-$tag.log" 2>&1 || { cat "$dir/auditwheel-$tag.log" >&2; exit 1; }
wheel=$(ls "$dir/wheelhouse"/ckptio-*-"$tag"-"$tag"-"$plat".whl)
"$venv/bin/auditwheel" show "$wheel" 2>/dev/null | sed -n '1,4p' >&2
say "$(du -k "$wheel" | cut -f1) KiB"

# The sdist, for where no wheel fits: meson dist's tarball of the committed tree (the build
# backend checks the -dev packages when it is built).
say "sdist"
rm -rf "$dir/sdist"
PATH="$venv/bin:$PATH" "$venv/bin/python" -m build --sdist --no-isolation --outdir "$dir/sdist" \
  > "$dir/sdist-$tag.log" 2>&1 || { tail -n 20 "$dir/sdist-$tag.log" >&2; exit 1; }
say "$(ls "$dir"/sdist/*.tar.gz)"
echo "$wheel"
