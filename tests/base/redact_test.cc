// Recognising and redacting credentials in text.

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "base/redact.h"

namespace ckptio::base {
namespace {

bool Contains(const std::string& s, std::string_view what) { return s.find(what) != std::string::npos; }

TEST_CASE("a server message that echoes our request loses the token and keeps its words") {
  const std::string echo =
      "Invalid argument; you sent: {'Host': 'storage.googleapis.com', "
      "'Authorization': 'Bearer ya29.a0AfB_byC-secret_token', 'Content-Range': 'bytes */100'}";
  const std::string out = RedactCredentials(echo);
  CHECK_FALSE(Contains(out, "ya29"));
  CHECK_FALSE(Contains(out, "secret_token"));
  CHECK(Contains(out, "'Authorization': 'Bearer <redacted>'"));
  CHECK(Contains(out, "Invalid argument; you sent: {'Host': 'storage.googleapis.com'"));
  CHECK(Contains(out, "'Content-Range': 'bytes */100'"));
}

TEST_CASE("our own token is redacted wherever it stands, even without a Bearer in front") {
  const std::vector<std::string> known = {"opaque-token-1234", ""};
  const std::string out = RedactCredentials("token=opaque-token-1234&again:opaque-token-1234.", known);
  CHECK(out == "token=<redacted>&again:<redacted>.");
}

TEST_CASE("a ya29 token, a Basic credential and a lower-case bearer are redacted, short words are not") {
  CHECK(RedactCredentials("saw ya29.c.abc-DEF_123 here") == "saw <redacted> here");
  CHECK(RedactCredentials("authorization: basic dXNlcjpwYXNzd29yZA==") == "authorization: basic <redacted>");
  CHECK(RedactCredentials("\"bearer  eyJhbGciOiJSUzI1NiJ9.e30.c2ln\"") == "\"bearer  <redacted>\"");
  CHECK(RedactCredentials("a Bearer token is required") == "a Bearer token is required");
  CHECK(RedactCredentials("Basic auth is not supported") == "Basic auth is not supported");
}

TEST_CASE("credential-looking values are recognised, ordinary ones are not") {
  CHECK(LooksLikeCredential("Bearer ya29.xyz"));
  CHECK(LooksLikeCredential("  bearer abc"));
  CHECK(LooksLikeCredential("Basic dXNlcjpwYXNz"));
  CHECK(LooksLikeCredential("ya29.a0Af"));
  CHECK(LooksLikeCredential("1//0gLm-refresh"));
  CHECK(LooksLikeCredential("AIzaSyD-1234567890abcdefghijklmnopq"));
  CHECK(LooksLikeCredential("eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ4In0.c2lnbmF0dXJl"));
  CHECK(LooksLikeCredential("https://user:pw@proxy.example/"));
  CHECK(LooksLikeCredential("GOCSPX-3kq9Zr8LmQ2vXy7TbNw4"));  // a long random word
  CHECK_FALSE(LooksLikeCredential("on"));
  CHECK_FALSE(LooksLikeCredential("my-billing-project"));
  CHECK_FALSE(LooksLikeCredential("ckptio/1.0 (training run 7)"));
  CHECK_FALSE(LooksLikeCredential("application/octet-stream"));
  CHECK_FALSE(LooksLikeCredential("Bearer"));
}

}  // namespace
}  // namespace ckptio::base
