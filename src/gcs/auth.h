#pragma once
// Credentials for the GCS JSON API, found the way Google's own clients find
// them:
//   1. STORAGE_EMULATOR_HOST set: an emulator, no credentials;
//   2. GOOGLE_APPLICATION_CREDENTIALS names a JSON file: a service-account
//      key (an RS256 JWT signed with OpenSSL, exchanged at its token_uri) or
//      an authorized-user refresh token;
//   3. otherwise the metadata server (GCE_METADATA_HOST, default
//      metadata.google.internal), with the header Metadata-Flavor: Google.
// Tokens are cached, refreshed a minute before they expire, and one refresh
// is shared by every request that needs it. Tokens, keys and refresh tokens
// never appear in a log line or an error message.
//
// Threads: loop thread only.

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "ckptio/options.h"
#include "ckptio/status.h"
#include "gcs/clock.h"
#include "runtime/task.h"
#include "http/http_client.h"
#include "runtime/async_sync.h"
#include "runtime/loop.h"

namespace ckptio::gcs {

class AuthProvider {
 public:
  virtual ~AuthProvider() = default;
  // The header line to send ("Authorization: Bearer ..."), or "" for none.
  virtual Task<Result<std::string>> Header() = 0;
  // False iff Header() never sends anything (an emulator).
  virtual bool SendsCredentials() const { return true; }
  // A request was refused with 401: forget the cached token.
  virtual void Invalidate() = 0;
  // What kind of credentials, and whose; no secrets.
  virtual std::string Describe() const = 0;
  // The secrets requests may carry (the current and the previous access
  // token, a refresh token, ...), to redact from what servers answer.
  virtual std::vector<std::string> Secrets() const { return {}; }
  // Tokens fetched so far (tests check refresh and sharing).
  virtual int tokens_fetched() const { return 0; }
};

// A provider that caches an OAuth2 access token and refreshes it.
class TokenAuth : public AuthProvider {
 public:
  TokenAuth(runtime::Loop& loop, http::HttpClient& http, Options::Gcs::Retry retry)
      : loop_(loop), http_(http), retry_(retry) {}
  Task<Result<std::string>> Header() final;
  void Invalidate() final {
    if (!token_.empty()) previous_token_ = std::exchange(token_, {});
  }
  int tokens_fetched() const final { return fetched_; }
  // The clock that says when the cached token is due for a refresh. Tests
  // set one they move themselves, to pass a token's lifetime without
  // waiting it out.
  void SetClockForTesting(Now now) { now_ = std::move(now); }
  // The tokens, and the subclass's own secrets. (The previous token too: a
  // request sent with it may be answered after a refresh.)
  std::vector<std::string> Secrets() const final;

 protected:
  struct Token {
    std::string access_token;
    std::chrono::seconds expires_in{0};
  };
  // One attempt at a token, done within `time_limit` (what is left of
  // gcs.retry.deadline); retried by Header() when the failure is transient.
  virtual Task<Result<Token>> Fetch(std::chrono::milliseconds time_limit) = 0;
  // Parses {"access_token": ..., "expires_in": ...} from a token endpoint.
  static Result<Token> ParseTokenResponse(const http::Response& r, const std::string& what);
  // Secrets of the subclass (a refresh token, a client secret).
  virtual std::vector<std::string> OwnSecrets() const { return {}; }

  runtime::Loop& loop_;
  http::HttpClient& http_;

 private:
  Task<Status> Refresh();

  Options::Gcs::Retry retry_;
  std::string token_;
  std::string previous_token_;
  Now now_ = std::chrono::steady_clock::now;
  std::chrono::steady_clock::time_point refresh_at_;  // by now_
  bool refreshing_ = false;
  runtime::AsyncEvent refreshed_;
  Status last_error_;
  int fetched_ = 0;
};

// Chooses credentials from the environment (see the file comment).
// `emulator` is true when STORAGE_EMULATOR_HOST is in use.
Result<std::unique_ptr<AuthProvider>> MakeAuth(runtime::Loop& loop, http::HttpClient& http,
                                               const Options::Gcs& options, bool emulator);

// The pieces, for tests.
Result<std::unique_ptr<AuthProvider>> ServiceAccountAuth(runtime::Loop& loop, http::HttpClient& http,
                                                         const Options::Gcs& options, const std::string& json,
                                                         const std::string& source);
Result<std::unique_ptr<AuthProvider>> AuthorizedUserAuth(runtime::Loop& loop, http::HttpClient& http,
                                                         const Options::Gcs& options, const std::string& json,
                                                         const std::string& source);
std::unique_ptr<AuthProvider> MetadataServerAuth(runtime::Loop& loop, http::HttpClient& http,
                                                 const Options::Gcs& options, std::string host);

// base64url without padding, as JWTs use it.
std::string Base64Url(std::string_view bytes);

}  // namespace ckptio::gcs
