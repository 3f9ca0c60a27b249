#include "gcs/auth.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "base/status_macros.h"
#include "gcs/gcs_url.h"
#include "gcs/retry.h"
#include "runtime/io_ops.h"

namespace ckptio::gcs {
namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

constexpr const char* kScope = "https://www.googleapis.com/auth/devstorage.read_write";
constexpr const char* kDefaultTokenUri = "https://oauth2.googleapis.com/token";
// Refresh this long before the token expires, so no request carries a token
// that dies in flight.
constexpr std::chrono::seconds kRefreshMargin{60};

struct PkeyDeleter {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
struct MdCtxDeleter {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};
struct BioDeleter {
  void operator()(BIO* b) const { BIO_free(b); }
};
using UniquePkey = std::unique_ptr<EVP_PKEY, PkeyDeleter>;

Result<std::string> StringField(const Json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || !j[key].is_string() || j[key].get<std::string>().empty()) {
    return InvalidArgumentError(source + ": missing or empty string field \"" + key + "\"");
  }
  return j[key].get<std::string>();
}

std::string FormBody(std::initializer_list<std::pair<const char*, std::string>> fields) {
  std::string out;
  for (const auto& [k, v] : fields) {
    if (!out.empty()) out += '&';
    out += k;
    out += '=';
    out += UrlEncode(v);
  }
  return out;
}

// ---- service account: a JWT signed with the account's RSA key ----

class ServiceAccount final : public TokenAuth {
 public:
  ServiceAccount(runtime::Loop& loop, http::HttpClient& http, Options::Gcs::Retry retry, std::string email,
                 std::string key_id, UniquePkey key, std::string token_uri)
      : TokenAuth(loop, http, retry), email_(std::move(email)), key_id_(std::move(key_id)), key_(std::move(key)),
        token_uri_(std::move(token_uri)) {}
  std::string Describe() const override { return "service account " + email_ + " (token_uri " + token_uri_ + ")"; }

 protected:
  Task<Result<Token>> Fetch(std::chrono::milliseconds time_limit) override {
    CO_ASSIGN_OR_RETURN(std::string jwt, MakeJwt());
    http::Request r;
    r.method = "POST";
    r.url = token_uri_;
    r.headers = {"Content-Type: application/x-www-form-urlencoded"};
    r.body = FormBody({{"grant_type", "urn:ietf:params:oauth:grant-type:jwt-bearer"}, {"assertion", jwt}});
    r.time_limit = time_limit;
    auto resp = co_await http_.Send(std::move(r));
    const std::string what = "get an access token for " + email_ + " from " + token_uri_;
    const std::string secrets[] = {jwt};
    Outcome o = Classify(resp, what, secrets);
    if (!o.status.ok()) co_return o.status;
    co_return ParseTokenResponse(*resp, what);
  }

 private:
  Result<std::string> MakeJwt() const {
    const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch()).count();
    Json header = {{"alg", "RS256"}, {"typ", "JWT"}, {"kid", key_id_}};
    Json claims = {{"iss", email_}, {"scope", kScope}, {"aud", token_uri_}, {"iat", now}, {"exp", now + 3600}};
    std::string signing_input = Base64Url(header.dump()) + "." + Base64Url(claims.dump());
    std::unique_ptr<EVP_MD_CTX, MdCtxDeleter> ctx(EVP_MD_CTX_new());
    size_t len = 0;
    if (!ctx || EVP_DigestSignInit(ctx.get(), nullptr, EVP_sha256(), nullptr, key_.get()) != 1 ||
        EVP_DigestSign(ctx.get(), nullptr, &len, reinterpret_cast<const unsigned char*>(signing_input.data()),
                       signing_input.size()) != 1) {
      return InternalError("cannot sign the token request for " + email_ + " with its key (OpenSSL)");
    }
    std::string sig(len, '\0');
    if (EVP_DigestSign(ctx.get(), reinterpret_cast<unsigned char*>(sig.data()), &len,
                       reinterpret_cast<const unsigned char*>(signing_input.data()), signing_input.size()) != 1) {
      return InternalError("cannot sign the token request for " + email_ + " with its key (OpenSSL)");
    }
    sig.resize(len);
    return signing_input + "." + Base64Url(sig);
  }

  std::string email_;
  std::string key_id_;
  UniquePkey key_;
  std::string token_uri_;
};

// ---- authorized user: a refresh token from `gcloud auth application-default login` ----

class AuthorizedUser final : public TokenAuth {
 public:
  AuthorizedUser(runtime::Loop& loop, http::HttpClient& http, Options::Gcs::Retry retry, std::string client_id,
                 std::string client_secret, std::string refresh_token, std::string token_uri)
      : TokenAuth(loop, http, retry), client_id_(std::move(client_id)), client_secret_(std::move(client_secret)),
        refresh_token_(std::move(refresh_token)), token_uri_(std::move(token_uri)) {}
  std::string Describe() const override { return "authorized user (client " + client_id_ + ")"; }

 protected:
  std::vector<std::string> OwnSecrets() const override { return {refresh_token_, client_secret_}; }
  Task<Result<Token>> Fetch(std::chrono::milliseconds time_limit) override {
    http::Request r;
    r.method = "POST";
    r.url = token_uri_;
    r.headers = {"Content-Type: application/x-www-form-urlencoded"};
    r.body = FormBody({{"grant_type", "refresh_token"},
                       {"client_id", client_id_},
                       {"client_secret", client_secret_},
                       {"refresh_token", refresh_token_}});
    r.time_limit = time_limit;
    auto resp = co_await http_.Send(std::move(r));
    const std::string what = "refresh the access token of client " + client_id_ + " at " + token_uri_;
    Outcome o = Classify(resp, what, OwnSecrets());
    if (!o.status.ok()) co_return o.status;
    co_return ParseTokenResponse(*resp, what);
  }

 private:
  std::string client_id_;
  std::string client_secret_;
  std::string refresh_token_;
  std::string token_uri_;
};

// ---- the metadata server of a GCE / GKE / TPU VM ----

class MetadataServer final : public TokenAuth {
 public:
  // `origin` says where the host came from; `last_resort` is set when no
  // other source of credentials was found, and is added to every failure.
  MetadataServer(runtime::Loop& loop, http::HttpClient& http, Options::Gcs::Retry retry, std::string host,
                 std::string origin, std::string last_resort)
      : TokenAuth(loop, http, retry), host_(std::move(host)), origin_(std::move(origin)),
        last_resort_(std::move(last_resort)) {}
  std::string Describe() const override {
    return "metadata server " + host_ + (origin_.empty() ? "" : " (" + origin_ + ")");
  }

 protected:
  Task<Result<Token>> Fetch(std::chrono::milliseconds time_limit) override {
    http::Request r;
    r.url = "http://" + host_ + "/computeMetadata/v1/instance/service-accounts/default/token";
    r.headers = {"Metadata-Flavor: Google"};
    r.time_limit = time_limit;
    auto resp = co_await http_.Send(std::move(r));
    const std::string what = "get an access token from the metadata server " + host_;
    Outcome o = Classify(resp, what);
    Result<Token> token = o.status.ok() ? ParseTokenResponse(*resp, what) : Result<Token>(o.status);
    if (token.ok() || last_resort_.empty()) co_return token;
    const Status& s = token.status();
    co_return Status(s.code(), s.message() + "; " + last_resort_, s.sys_errno());
  }

 private:
  std::string host_;
  std::string origin_;
  std::string last_resort_;
};

class NoAuth final : public AuthProvider {
 public:
  Task<Result<std::string>> Header() override { co_return std::string(); }
  void Invalidate() override {}
  bool SendsCredentials() const override { return false; }
  std::string Describe() const override { return "no credentials (emulator)"; }
};

}  // namespace

std::string Base64Url(std::string_view bytes) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out;
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    uint32_t v = (uint8_t(bytes[i]) << 16) | (uint8_t(bytes[i + 1]) << 8) | uint8_t(bytes[i + 2]);
    for (int k = 3; k >= 0; --k) out += kAlphabet[(v >> (6 * k)) & 63];
  }
  if (size_t rest = bytes.size() - i) {
    uint32_t v = uint8_t(bytes[i]) << 16;
    if (rest == 2) v |= uint8_t(bytes[i + 1]) << 8;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    if (rest == 2) out += kAlphabet[(v >> 6) & 63];
  }
  return out;
}

Result<TokenAuth::Token> TokenAuth::ParseTokenResponse(const http::Response& r, const std::string& what) {
  Json j = Json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("access_token") || !j["access_token"].is_string() ||
      !j.contains("expires_in") || !j["expires_in"].is_number()) {
    return UnavailableError(what + ": the answer has no access_token and expires_in");
  }
  return Token{j["access_token"].get<std::string>(), std::chrono::seconds(j["expires_in"].get<int64_t>())};
}

std::vector<std::string> TokenAuth::Secrets() const {
  std::vector<std::string> out = OwnSecrets();
  out.push_back(token_);
  out.push_back(previous_token_);
  return out;
}

Task<Status> TokenAuth::Refresh() {
  // Bounded as a whole by gcs.retry.deadline, like any metadata operation:
  // each attempt gets what is left of it.
  Backoff backoff(retry_);
  for (;;) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(backoff.deadline() - Clock::now());
    auto token = co_await Fetch(std::max(left, std::chrono::milliseconds(1)));
    if (token.ok()) {
      ++fetched_;
      if (!token_.empty()) previous_token_ = std::move(token_);
      token_ = std::move(token->access_token);
      auto lifetime = std::max(token->expires_in - kRefreshMargin, token->expires_in / 2);
      refresh_at_ = now_() + lifetime;
      co_return Status::Ok();
    }
    std::chrono::milliseconds delay;
    bool transient = token.status().code() == StatusCode::kUnavailable ||
                     token.status().code() == StatusCode::kDeadlineExceeded;
    if (!transient) co_return token.status();
    if (!backoff.Next(&delay)) {
      const Status& s = token.status();
      co_return Status(s.code(), s.message() + " (" + backoff.Exhausted() + ")", s.sys_errno());
    }
    Status slept = co_await loop_.Sleep(delay);
    slept.IgnoreError();
  }
}

Task<Result<std::string>> TokenAuth::Header() {
  if (!token_.empty() && now_() < refresh_at_) co_return "Authorization: Bearer " + token_;
  if (refreshing_) {
    // One refresh serves everybody who needs a token meanwhile.
    co_await refreshed_.Wait();
  } else {
    refreshing_ = true;
    refreshed_.Reset();
    last_error_ = co_await Refresh();
    refreshing_ = false;
    refreshed_.Set();
  }
  if (token_.empty()) {
    co_return last_error_.ok() ? UnavailableError("no access token") : last_error_;
  }
  co_return "Authorization: Bearer " + token_;
}

Result<std::unique_ptr<AuthProvider>> ServiceAccountAuth(runtime::Loop& loop, http::HttpClient& http,
                                                         const Options::Gcs& options, const std::string& json,
                                                         const std::string& source) {
  Json j = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return InvalidArgumentError(source + ": not a JSON object");
  ASSIGN_OR_RETURN(std::string email, StringField(j, "client_email", source));
  ASSIGN_OR_RETURN(std::string pem, StringField(j, "private_key", source));
  std::string key_id = j.value("private_key_id", "");
  std::string token_uri = j.value("token_uri", kDefaultTokenUri);
  std::unique_ptr<BIO, BioDeleter> bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  UniquePkey key(PEM_read_bio_PrivateKey(bio.get(), nullptr, nullptr, nullptr));
  if (!key) return InvalidArgumentError(source + ": private_key is not a PEM private key");
  if (EVP_PKEY_get_base_id(key.get()) != EVP_PKEY_RSA) {
    return InvalidArgumentError(source + ": private_key is not an RSA key");
  }
  return std::unique_ptr<AuthProvider>(
      new ServiceAccount(loop, http, options.retry, std::move(email), std::move(key_id), std::move(key), std::move(token_uri)));
}

Result<std::unique_ptr<AuthProvider>> AuthorizedUserAuth(runtime::Loop& loop, http::HttpClient& http,
                                                         const Options::Gcs& options, const std::string& json,
                                                         const std::string& source) {
  Json j = Json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return InvalidArgumentError(source + ": not a JSON object");
  ASSIGN_OR_RETURN(std::string id, StringField(j, "client_id", source));
  ASSIGN_OR_RETURN(std::string secret, StringField(j, "client_secret", source));
  ASSIGN_OR_RETURN(std::string refresh, StringField(j, "refresh_token", source));
  std::string token_uri = j.value("token_uri", kDefaultTokenUri);
  return std::unique_ptr<AuthProvider>(new AuthorizedUser(loop, http, options.retry, std::move(id), std::move(secret),
                                                          std::move(refresh), std::move(token_uri)));
}

std::unique_ptr<AuthProvider> MetadataServerAuth(runtime::Loop& loop, http::HttpClient& http,
                                                 const Options::Gcs& options, std::string host) {
  return std::unique_ptr<AuthProvider>(new MetadataServer(loop, http, options.retry, std::move(host), "", ""));
}

Result<std::unique_ptr<AuthProvider>> MakeAuth(runtime::Loop& loop, http::HttpClient& http,
                                               const Options::Gcs& options, bool emulator) {
  if (emulator) return std::unique_ptr<AuthProvider>(new NoAuth());
  if (const char* path = std::getenv("GOOGLE_APPLICATION_CREDENTIALS"); path && *path) {
    std::ifstream in(path);
    if (!in) return ErrnoToStatus(errno, "cannot read GOOGLE_APPLICATION_CREDENTIALS file", path);
    std::string json((std::istreambuf_iterator<char>(in)), {});
    Json j = Json::parse(json, nullptr, /*allow_exceptions=*/false);
    std::string type = j.is_object() ? j.value("type", "") : "";
    if (type == "service_account") return ServiceAccountAuth(loop, http, options, json, path);
    if (type == "authorized_user") return AuthorizedUserAuth(loop, http, options, json, path);
    return InvalidArgumentError(std::string(path) +
                                ": credentials of type \"service_account\" or \"authorized_user\" expected, got \"" +
                                type + "\"");
  }
  // The last resort. Its failure (on a machine outside Google Cloud: a DNS
  // error for metadata.google.internal) says what else was looked for.
  const char* env_host = std::getenv("GCE_METADATA_HOST");
  const bool from_env = env_host != nullptr && *env_host != '\0';
  const std::string host = from_env ? env_host : "metadata.google.internal";
  const std::string origin = from_env ? "from GCE_METADATA_HOST" : "the default: GCE_METADATA_HOST is not set";
  std::string last_resort =
      "no other credentials were found (STORAGE_EMULATOR_HOST and GOOGLE_APPLICATION_CREDENTIALS are not set), so "
      "the metadata server " + host + " was the last source tried: set GOOGLE_APPLICATION_CREDENTIALS to a "
      "service-account or authorized-user JSON file, STORAGE_EMULATOR_HOST to an emulator, or run where a metadata "
      "server answers (Compute Engine, GKE, Cloud TPU)";
  return std::unique_ptr<AuthProvider>(
      new MetadataServer(loop, http, options.retry, host, origin, std::move(last_resort)));
}

}  // namespace ckptio::gcs
