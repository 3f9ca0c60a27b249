#!/usr/bin/env bash
# The toolchain and the static libraries of the ckptio wheel (make wheel), built once into DIR
# (default build-wheel/deps) and reused while this script is unchanged (DIR/.done holds its hash).
#
#   DIR/sysroot   glibc 2.31's headers and libraries from Debian 11 (bullseye): the wheel is
#                 compiled against them and links against this libc, so it asks for no glibc
#                 symbol newer than 2.31, whatever the build machine runs (bookworm: 2.36). The
#                 Linux UAPI headers are bookworm's (6.1): they only name kernel constants and
#                 structures (STATX_DIOALIGN, io_uring's), and ckptio probes the running kernel.
#   DIR/prefix    static PIC libraries with their headers and .pc files, the only ones meson sees:
#                   libcurl 7.88.1   Debian bookworm's source (its security patches applied),
#                                    built here: HTTP(S) only, proxies, HTTP/2, threaded resolver;
#                                    no FTP/LDAP/SMTP/..., cookies, zlib, ssh, idn, psl, kerberos
#                   nghttp2 1.52.0   Debian bookworm's source, the library only (curl's HTTP/2)
#                   ISA-L 2.30.0     Debian bookworm's source, the CRC unit only (crc32_iscsi)
#                   OpenSSL 3.0.x    libssl.a/libcrypto.a of Debian bookworm's libssl-dev (the
#                                    newest, security updates included; PIC)
#                   liburing 2.3     liburing.a of Debian bookworm's liburing-dev (it uses no libc
#                                    but calloc/free)
#                 plus the header-only nlohmann-json and xxhash of this machine.
#   DIR/compat.o  __libc_single_threaded and arc4random for the static libstdc++ of g++ 12, which
#                 was built against glibc 2.36 (packaging/glibc_compat.c says why that is sound).
#   DIR/native.ini  the meson native file that ties it together (pass it as --native-file).
#   DIR/licenses  the license of every component linked into the wheel.
#
# Sources come from Debian's archive through a private apt configuration under DIR/apt (the
# machine's own apt sources are not touched): bookworm (+ security) for sources and the static
# archives, bullseye (+ security) for libc6-dev. Needs: g++, make, cmake, nasm, dpkg-dev, and network to
# deb.debian.org. Everything compiles at nice 10. From scratch: about 100 s on 2 loaded cores.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=$(realpath -m "${1:-build-wheel/deps}")
hash=$(cat "$0" "$here/glibc_compat.c" | sha256sum | cut -c1-16)
if [ -f "$dir/.done" ] && [ "$(cat "$dir/.done")" = "$hash" ]; then
  echo "build-deps: $dir is up to date"; exit 0
fi
start=$SECONDS
jobs=$(nproc)
sysroot=$dir/sysroot
prefix=$dir/prefix
src=$dir/src
mkdir -p "$dir" "$prefix/lib/pkgconfig" "$prefix/include" "$dir/licenses"
step() { echo "build-deps: $* ($((SECONDS - start)) s)" >&2; }

# ---- the private apt configuration ----
apt=$dir/apt
mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$apt/state"
touch "$apt/state/status"
key=/usr/share/keyrings/debian-archive-keyring.gpg
cat > "$apt/sources.list" <<EOF
deb [signed-by=$key] http://deb.debian.org/debian bullseye main
deb [signed-by=$key] http://deb.debian.org/debian-security bullseye-security main
deb [signed-by=$key] http://deb.debian.org/debian bookworm main
deb [signed-by=$key] http://deb.debian.org/debian-security bookworm-security main
deb-src [signed-by=$key] http://deb.debian.org/debian bookworm main
deb-src [signed-by=$key] http://deb.debian.org/debian-security bookworm-security main
EOF
apt_opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
  -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o "Dir::State::status=$apt/state/status"
  -o APT::Architecture=amd64 -o Debug::NoLocking=1 -o APT::Sandbox::User=root -qq)
step "apt-get update (private lists in $apt)"
apt-get "${apt_opts[@]}" update

# ---- the sysroot: bullseye's glibc 2.31 ----
step "sysroot: glibc 2.31 from bullseye"
rm -rf "$sysroot" "$apt/debs" && mkdir -p "$sysroot" "$apt/debs"
(cd "$apt/debs" && apt-get "${apt_opts[@]}" download libc6/bullseye-security libc6-dev/bullseye-security \
  libcrypt1/bullseye libcrypt-dev/bullseye libgcc-s1/bullseye \
  linux-libc-dev)  # linux-libc-dev: the newest, bookworm's
for deb in "$apt/debs"/*.deb; do dpkg-deb -x "$deb" "$sysroot"; done
# -lgcc_s finds this one first (gcc 10's, which needs glibc 2.2.5 only; g++ 12's own wants 2.35),
# so that linking the ckptio executable checks its libgcc_s symbols against what a glibc 2.31
# system has. At run time the system's libgcc_s.so.1 is loaded, as on every manylinux system.
# Like g++'s own libgcc_s.so, a script that adds libgcc.a (__cpu_model, ...).
echo "GROUP ( libgcc_s.so.1 -lgcc )" > "$sysroot/usr/lib/x86_64-linux-gnu/libgcc_s.so"
# Absolute symlinks (lib64/ld-linux-x86-64.so.2, libpthread.so, ...) would point into the
# build machine's own /lib: make them relative, inside the sysroot.
find "$sysroot" -type l -lname '/*' | while read -r link; do
  ln -sfn "$(realpath -m --relative-to="$(dirname "$link")" "$sysroot$(readlink "$link")")" "$link"
done
(cd "$apt/debs" && ls) > "$dir/sysroot.txt"

# The flags that make gcc compile against the sysroot and link against its libc: -B for the
# start files (crt1.o of glibc 2.34+ calls a __libc_start_main that does not run constructors
# under 2.31's), -L first so that its libc.so wins over the build machine's.
sys_cflags="--sysroot=$sysroot"
sys_ldflags="--sysroot=$sysroot -B$sysroot/usr/lib/x86_64-linux-gnu -L$sysroot/usr/lib/x86_64-linux-gnu -L$sysroot/lib/x86_64-linux-gnu"
cflags="$sys_cflags -O2 -fPIC -ffunction-sections -fdata-sections -fstack-protector-strong -D_FORTIFY_SOURCE=2"

# ---- sources ----
step "sources: curl, nghttp2, libisal (bookworm)"
rm -rf "$src" && mkdir -p "$src"
(cd "$src" && apt-get "${apt_opts[@]}" source curl nghttp2 libisal > "$src/apt-source.log" 2>&1) \
  || { cat "$src/apt-source.log" >&2; exit 1; }
curl_src=$(echo "$src"/curl-*/) nghttp2_src=$(echo "$src"/nghttp2-*/) isal_src=$(echo "$src"/libisal-*/)
(cd "$src" && ls ./*.dsc | sed 's|^\./||') > "$dir/sources.txt"

# ---- OpenSSL and liburing: Debian bookworm's static archives (PIC) ----
step "OpenSSL, liburing: bookworm's static archives"
debs=$apt/debs-bookworm
rm -rf "$debs" && mkdir -p "$debs/root"
(cd "$debs" && apt-get "${apt_opts[@]}" download libssl-dev liburing-dev)  # the newest: bookworm(-security)
for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$debs/root"; done
(cd "$debs" && ls ./*.deb | sed 's|^\./||') > "$dir/binaries.txt"
from=$debs/root/usr
cp "$from"/lib/x86_64-linux-gnu/{libssl.a,libcrypto.a,liburing.a} "$prefix/lib/"
rm -rf "$prefix/include/openssl" "$prefix/include/liburing"
cp -r "$from/include/openssl" "$prefix/include/"
cp "$from"/include/x86_64-linux-gnu/openssl/*.h "$prefix/include/openssl/"
cp -r "$from/include/liburing" "$from/include/liburing.h" "$prefix/include/"
deb_version() { dpkg-deb -f "$debs"/"$1"_*.deb Version; }
ssl_version=$(deb_version libssl-dev)
uring_version=$(deb_version liburing-dev)
for pc in libcrypto libssl openssl; do
  case $pc in
    libcrypto) libs="-lcrypto"; private="-ldl -pthread"; requires="" ;;
    libssl) libs="-lssl"; private=""; requires="libcrypto" ;;
    openssl) libs=""; private=""; requires="libssl libcrypto" ;;
  esac
  cat > "$prefix/lib/pkgconfig/$pc.pc" <<EOF
prefix=$prefix
Name: $pc
Description: OpenSSL $ssl_version (Debian libssl-dev, static)
Version: ${ssl_version%%-*}
Requires: $requires
Libs: -L\${prefix}/lib $libs
Libs.private: $private
Cflags: -I\${prefix}/include
EOF
done
cat > "$prefix/lib/pkgconfig/liburing.pc" <<EOF
prefix=$prefix
Name: liburing
Description: io_uring library $uring_version (Debian liburing-dev, static)
Version: ${uring_version%%-*}
Libs: -L\${prefix}/lib -luring
Cflags: -I\${prefix}/include
EOF

# ---- header-only libraries of this machine ----
rm -rf "$prefix/include/nlohmann" && cp -r /usr/include/nlohmann "$prefix/include/"
cp /usr/include/xxhash.h "$prefix/include/"
cat > "$prefix/lib/pkgconfig/nlohmann_json.pc" <<EOF
Name: nlohmann_json
Description: JSON for Modern C++ (headers)
Version: $(dpkg-query -W -f='${Version}' nlohmann-json3-dev | sed 's/-.*//')
Cflags: -I$prefix/include
EOF
cat > "$prefix/lib/pkgconfig/libxxhash.pc" <<EOF
Name: libxxhash
Description: xxHash (header-only use)
Version: $(dpkg-query -W -f='${Version}' libxxhash-dev | sed 's/^[0-9]*://; s/-.*//')
Cflags: -I$prefix/include
EOF

# ---- ISA-L: the CRC unit ----
step "ISA-L (crc unit)"
(cd "$isal_src" && nice -n 10 make -s -f Makefile.unx -j"$jobs" units=crc lib \
  CFLAGS_="-Wall $cflags" > build.log 2>&1) || { tail -n 40 "$isal_src/build.log" >&2; exit 1; }
cp "$isal_src/bin/isa-l.a" "$prefix/lib/libisal.a"
mkdir -p "$prefix/include/isa-l" && cp "$isal_src/include/crc.h" "$isal_src/include/crc64.h" "$prefix/include/isa-l/"
isal_version=$(sed -n 's/^version ?= *//p' "$isal_src/make.inc")
cat > "$prefix/lib/pkgconfig/libisal.pc" <<EOF
prefix=$prefix
Name: libisal
Description: Intel ISA-L $isal_version, CRC functions only (static)
Version: $isal_version
Libs: -L\${prefix}/lib -lisal
Cflags: -I\${prefix}/include
EOF

# ---- nghttp2: the library ----
step "nghttp2 (library only)"
rm -rf "$nghttp2_src/_build"
(cd "$nghttp2_src" && CFLAGS="$cflags" LDFLAGS="$sys_ldflags" nice -n 10 cmake -S . -B _build -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_INSTALL_LIBDIR=lib -DENABLE_LIB_ONLY=ON -DENABLE_STATIC_LIB=ON \
  -DENABLE_SHARED_LIB=OFF -DENABLE_DOC=OFF -DENABLE_FAILMALLOC=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
  > build.log 2>&1 && nice -n 10 cmake --build _build -j"$jobs" >> build.log 2>&1 \
  && cmake --install _build >> build.log 2>&1) || { tail -n 40 "$nghttp2_src/build.log" >&2; exit 1; }

# ---- libcurl ----
# The features ckptio uses (src/http): HTTP/1.1 with keep-alive, HTTP/2 (gcs.http_version "2";
# over TLS by ALPN, over plain HTTP with prior knowledge), TLS with certificate checks, proxies
# from http_proxy/https_proxy/no_proxy (with basic/digest auth), IPv6, and a resolver thread
# (the io_uring loop must never block on DNS). Everything else is left out: less code to load
# and less to attack. No CA bundle is compiled in: the build machine's path need not exist
# where the wheel runs, so src/http/ca_bundle.cc looks for the system's bundle at run time
# (and OpenSSL's defaults, SSL_CERT_FILE/SSL_CERT_DIR, are the fallback).
step "libcurl (HTTP/HTTPS only)"
(cd "$curl_src" && CPPFLAGS="-I$prefix/include" CFLAGS="$cflags" LDFLAGS="$sys_ldflags -L$prefix/lib" \
  LIBS="-ldl -pthread" PKG_CONFIG_LIBDIR="$prefix/lib/pkgconfig" nice -n 10 ./configure -q \
  --prefix="$prefix" --disable-shared --enable-static --with-pic --disable-maintainer-mode \
  --with-openssl="$prefix" --with-nghttp2="$prefix" --without-ca-bundle --without-ca-path --with-ca-fallback \
  --enable-http --enable-proxy --enable-ipv6 --enable-threaded-resolver --enable-http-auth --enable-crypto-auth \
  --enable-verbose --enable-symbol-hiding \
  --disable-ftp --disable-file --disable-ldap --disable-ldaps --disable-rtsp --disable-dict --disable-telnet \
  --disable-tftp --disable-pop3 --disable-imap --disable-smb --disable-smtp --disable-gopher --disable-mqtt \
  --disable-manual --disable-ntlm-wb --disable-tls-srp --disable-unix-sockets --disable-cookies --disable-doh \
  --disable-mime --disable-netrc --disable-alt-svc --disable-hsts --disable-websockets --disable-dateparse \
  --disable-get-easy-options --disable-libcurl-option --disable-docs \
  --without-zlib --without-brotli --without-zstd --without-libidn2 --without-libpsl --without-librtmp \
  --without-libssh2 --without-libssh --without-wolfssh --without-gssapi --without-libgsasl --without-hyper \
  --without-ngtcp2 --without-nghttp3 --without-quiche --without-msh3 --without-zsh-functions-dir \
  --without-fish-functions-dir > build.log 2>&1 \
  && nice -n 10 make -j"$jobs" -C lib > make.log 2>&1 && make -C lib install > /dev/null \
  && make -C include install > /dev/null && make install-pkgconfigDATA > /dev/null) \
  || { tail -n 40 "$curl_src/build.log" "$curl_src/make.log" >&2 2>/dev/null; exit 1; }
rm -f "$prefix"/lib/*.la
# What this curl can do, as curl itself says (checked by tests/wheel).
sed -n 's/^#define \(USE_[A-Z0-9_]*\|CURL_DISABLE_[A-Z0-9_]*\|ENABLE_IPV6\) 1$/\1/p' "$curl_src/lib/curl_config.h" \
  | sort > "$dir/curl-features.txt"

# ---- the glibc compatibility object ----
step "glibc_compat.o"
gcc $sys_cflags -O2 -fPIC -fvisibility=hidden -c "$here/glibc_compat.c" -o "$dir/compat.o"

# ---- licenses of what the wheel links in ----
step "licenses"
lic=$dir/licenses
rm -rf "$lic" && mkdir -p "$lic"
cp "$curl_src/COPYING" "$lic/curl.txt"
cp "$nghttp2_src/COPYING" "$lic/nghttp2.txt"
cp "$isal_src/LICENSE" "$lic/isa-l.txt"
cp "$from/share/doc/libssl-dev/copyright" "$lic/openssl.txt"
cp "$from/share/doc/liburing-dev/copyright" "$lic/liburing.txt"
cp /usr/share/doc/nlohmann-json3-dev/copyright "$lic/nlohmann-json.txt"
cp /usr/share/doc/libxxhash-dev/copyright "$lic/xxhash.txt"
cp /usr/share/doc/libstdc++-12-dev/copyright "$lic/libstdc++.txt"
{
  echo "Linked statically into ckptio's wheel (from Debian's archive):"
  sed 's/^/  source  /' "$dir/sources.txt"
  sed 's/^/  binary  /' "$dir/binaries.txt"
  echo "          (libssl.a, libcrypto.a, liburing.a)"
  echo "  binary  libstdc++-12-dev $(dpkg-query -W -f='${Version}' libstdc++-12-dev) (libstdc++.a)"
  echo "  headers nlohmann-json3-dev, libxxhash-dev"
  echo "Compiled against glibc and Linux headers of Debian 11:"
  sed 's/^/  /' "$dir/sysroot.txt"
} > "$lic/README.txt"

# ---- the meson native file ----
# prefer_static: dependency() asks pkg-config for --static flags and picks lib*.a;
# pkg_config_libdir: only the prefix's .pc files (nothing of the build machine's).
# -static-libstdc++ (libgcc_s stays shared: every manylinux system has it, and the static
# libgcc_eh of g++ 12 wants glibc 2.35's _dl_find_object). --exclude-libs keeps the static
# libraries' symbols out of the dynamic symbol table; --gc-sections drops what is unused.
q() { printf "'%s'" "$1"; }
list() { local out="" x; for x in "$@"; do out+="${out:+, }$(q "$x")"; done; printf '[%s]' "$out"; }
read -r -a sys_ldflags_a <<< "$sys_ldflags"
cat > "$dir/native.ini" <<EOF
# Written by packaging/build-deps.sh: the toolchain of the ckptio wheel.
[properties]
pkg_config_libdir = $(list "$prefix/lib/pkgconfig")

[built-in options]
prefer_static = true
c_args = $(list "$sys_cflags" -ffunction-sections -fdata-sections)
cpp_args = $(list "$sys_cflags" -ffunction-sections -fdata-sections)
c_link_args = $(list "${sys_ldflags_a[@]}" -Wl,--gc-sections -Wl,--exclude-libs,ALL "$dir/compat.o")
cpp_link_args = $(list "${sys_ldflags_a[@]}" -static-libstdc++ -Wl,--gc-sections -Wl,--exclude-libs,ALL "$dir/compat.o")
EOF

echo "$hash" > "$dir/.done"
step "done"
