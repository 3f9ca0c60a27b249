#include "http/ca_bundle.h"

#include <curl/curl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>

namespace ckptio::http {

const std::vector<std::string>& WellKnownCaBundles() {
  static const std::vector<std::string> kBundles = {
      "/etc/ssl/certs/ca-certificates.crt",                 // Debian, Ubuntu, Gentoo, Arch
      "/etc/pki/tls/certs/ca-bundle.crt",                   // Fedora, RHEL 6
      "/etc/ssl/ca-bundle.pem",                             // openSUSE
      "/etc/pki/tls/cacert.pem",                            // OpenELEC
      "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",  // CentOS, RHEL 7+
      "/etc/ssl/cert.pem",                                  // Alpine
  };
  return kBundles;
}

std::string FindCaBundle(const CaLookup& lookup) {
  if (lookup.curl_has_default || lookup.openssl_env_set) return "";
  for (const std::string& path : lookup.candidates) {
    struct stat st {};
    // stat follows links: RHEL's ca-bundle.crt links to the extracted bundle.
    if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), R_OK) == 0) return path;
  }
  return "";
}

const std::string& SystemCaBundle() {
  static const std::string kFound = [] {
    const curl_version_info_data* v = curl_version_info(CURLVERSION_NOW);
    CaLookup lookup;
    // cainfo and capath exist from CURLVERSION_NINTH (curl 7.70) on; meson.build asks for 7.80.
    lookup.curl_has_default = v->age < CURLVERSION_NINTH || v->cainfo != nullptr || v->capath != nullptr;
    lookup.openssl_env_set = std::getenv("SSL_CERT_FILE") != nullptr || std::getenv("SSL_CERT_DIR") != nullptr;
    lookup.candidates = WellKnownCaBundles();
    return FindCaBundle(lookup);
  }();
  return kFound;
}

std::string DescribeLibcurl() {
  const curl_version_info_data* v = curl_version_info(CURLVERSION_NOW);
  std::string out = curl_version();
  out += "; protocols:";
  for (const char* const* p = v->protocols; p != nullptr && *p != nullptr; ++p) out += std::string(" ") + *p;
  out += "; CA: ";
  const bool has_default = v->age >= CURLVERSION_NINTH && (v->cainfo != nullptr || v->capath != nullptr);
  if (has_default) {
    out += std::string(v->cainfo != nullptr ? v->cainfo : v->capath) + " (libcurl's default)";
  } else if (!SystemCaBundle().empty()) {
    out += SystemCaBundle();
  } else {
    out += "OpenSSL's default paths (SSL_CERT_FILE, SSL_CERT_DIR)";
  }
  return out;
}

}  // namespace ckptio::http
