#pragma once
// Which CA certificates https requests trust when the config names none
// (gcs.ca_file empty: "the system's").
//
// Debian's libcurl knows the system's bundle: its path was compiled in
// (/etc/ssl/certs/ca-certificates.crt), and curl uses it by default. The
// libcurl linked into ckptio's wheel (packaging/build-deps.sh) has no such
// path, since the wheel runs on distributions that keep the bundle in
// different places; for it, ckptio looks for the bundle in the places the
// Linux distributions use (the list Go's crypto/x509 searches). A user who
// sets SSL_CERT_FILE or SSL_CERT_DIR gets OpenSSL's defaults, which honour
// them (that curl falls back to them: --with-ca-fallback).
//
// Threads: any; no state.

#include <string>
#include <vector>

namespace ckptio::http {

// The distributions' bundle files, most common first.
const std::vector<std::string>& WellKnownCaBundles();

struct CaLookup {
  bool curl_has_default = false;  // curl_version_info()->cainfo or ->capath set
  bool openssl_env_set = false;   // SSL_CERT_FILE or SSL_CERT_DIR in the environment
  std::vector<std::string> candidates;
};

// The CA file to hand to curl (CURLOPT_CAINFO), or "" to leave curl to its own
// default: curl has one, OpenSSL's environment variables are set, or no
// candidate is a readable regular file (after links).
std::string FindCaBundle(const CaLookup& lookup);

// FindCaBundle for this process: this libcurl, this environment, the
// well-known places. Looked up once, on the first call.
const std::string& SystemCaBundle();

// One line for `ckptio --version` and bug reports: the libcurl in use, its TLS
// and HTTP/2 libraries, its protocols and which CA certificates https trusts:
// "libcurl/7.88.1 OpenSSL/3.0.22 nghttp2/1.52.0; protocols: http https; CA: /etc/ssl/...".
std::string DescribeLibcurl();

}  // namespace ckptio::http
