// Where https requests find the system's CA certificates when libcurl has no
// default of its own (the wheel's libcurl): real files in a scratch directory.

#include "http/ca_bundle.h"

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <string>

#include "test_util.h"

namespace ckptio::http {
namespace {

using testing::TempDir;
using testing::WriteWholeFile;

TEST_CASE("the first candidate that is a file is the bundle") {
  TempDir dir;
  WriteWholeFile(dir / "second.pem", "pem");
  WriteWholeFile(dir / "third.pem", "pem");
  CaLookup lookup;
  lookup.candidates = {dir / "missing.pem", dir / "second.pem", dir / "third.pem"};
  CHECK(FindCaBundle(lookup) == dir / "second.pem");
}

TEST_CASE("a link to a bundle counts (RHEL's ca-bundle.crt), a directory does not") {
  TempDir dir;
  REQUIRE(::mkdir((dir / "certs").c_str(), 0755) == 0);
  WriteWholeFile(dir / "tls-ca-bundle.pem", "pem");
  REQUIRE(::symlink((dir / "tls-ca-bundle.pem").c_str(), (dir / "ca-bundle.crt").c_str()) == 0);
  REQUIRE(::symlink((dir / "gone.pem").c_str(), (dir / "dangling.crt").c_str()) == 0);
  CaLookup lookup;
  lookup.candidates = {dir / "certs", dir / "dangling.crt", dir / "ca-bundle.crt"};
  CHECK(FindCaBundle(lookup) == dir / "ca-bundle.crt");
}

TEST_CASE("no candidate on this system: curl and OpenSSL keep their defaults") {
  TempDir dir;
  CaLookup lookup;
  lookup.candidates = {dir / "a.pem", dir / "b.pem"};
  CHECK(FindCaBundle(lookup) == "");
}

TEST_CASE("a libcurl with a CA bundle or path of its own is left to it") {
  TempDir dir;
  WriteWholeFile(dir / "ca.pem", "pem");
  CaLookup lookup;
  lookup.candidates = {dir / "ca.pem"};
  lookup.curl_has_default = true;
  CHECK(FindCaBundle(lookup) == "");
}

TEST_CASE("SSL_CERT_FILE or SSL_CERT_DIR in the environment wins over the well-known places") {
  TempDir dir;
  WriteWholeFile(dir / "ca.pem", "pem");
  CaLookup lookup;
  lookup.candidates = {dir / "ca.pem"};
  lookup.openssl_env_set = true;
  CHECK(FindCaBundle(lookup) == "");
}

TEST_CASE("Debian's bundle is the first place looked at") {
  REQUIRE(!WellKnownCaBundles().empty());
  CHECK(WellKnownCaBundles().front() == "/etc/ssl/certs/ca-certificates.crt");
}

}  // namespace
}  // namespace ckptio::http
