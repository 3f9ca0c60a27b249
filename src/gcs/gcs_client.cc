#include "gcs/gcs_client.h"

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>

#include "base/status_macros.h"
#include "format/crc32c.h"
#include "gcs/gcs_client_internal.h"
#include "gcs/gcs_url.h"
#include "gcs/retry.h"
#include "runtime/io_ops.h"
#include "base/redact.h"

namespace ckptio::gcs {

using internal::GaveUp;
using internal::ParseObjectBody;

namespace {

using Json = nlohmann::json;

uint64_t ToU64(const Json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer()) return static_cast<uint64_t>(std::max<int64_t>(0, v.get<int64_t>()));
  if (v.is_string()) {
    uint64_t out = 0;
    const std::string& s = v.get_ref<const std::string&>();
    std::from_chars(s.data(), s.data() + s.size(), out);
    return out;
  }
  return 0;
}

Result<ObjectMeta> ParseObject(const Json& j, const std::string& what) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) {
    return UnavailableError(what + ": the server's answer is not an object resource");
  }
  ObjectMeta m;
  m.name = j["name"].get<std::string>();
  if (j.contains("size")) m.size = ToU64(j["size"]);
  if (j.contains("generation")) m.generation = static_cast<int64_t>(ToU64(j["generation"]));
  if (j.contains("crc32c") && j["crc32c"].is_string()) {
    auto crc = format::Crc32cFromBase64(j["crc32c"].get<std::string>());
    if (crc.ok()) m.crc32c = *crc;
  }
  return m;
}

// The crc32c in an x-goog-hash header ("crc32c=AAAAAA==,md5=...").
std::optional<uint32_t> GoogHashCrc(std::string_view h) {
  size_t p = h.find("crc32c=");
  if (p == std::string_view::npos) return std::nullopt;
  std::string_view v = h.substr(p + 7);
  v = v.substr(0, v.find(','));
  auto crc = format::Crc32cFromBase64(v);
  if (!crc.ok()) return std::nullopt;
  return *crc;
}

}  // namespace

Result<ObjectMeta> internal::ParseObjectBody(const http::Response& r, const std::string& what) {
  Json j = Json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  return ParseObject(j, what);
}

Status internal::GaveUp(Status last, const Backoff& backoff) {
  return Status(last.code(), last.message() + " (" + backoff.Exhausted() + ")", last.sys_errno());
}

std::string GsUrl(const std::string& bucket, const std::string& name) { return "gs://" + bucket + "/" + name; }

GcsClient::GcsClient(runtime::Loop& loop, http::HttpClient& http, AuthProvider& auth, std::string endpoint,
                     Options::Gcs options, std::shared_ptr<UploadPacer> pacer)
    : loop_(loop), http_(http), auth_(auth), endpoint_(std::move(endpoint)), options_(std::move(options)),
      pacer_(std::move(pacer)) {
  while (!endpoint_.empty() && endpoint_.back() == '/') endpoint_.pop_back();
  if (pacer_ == nullptr && options_.max_upload_bandwidth > 0) {
    pacer_ = std::make_shared<UploadPacer>(options_.max_upload_bandwidth);
  }
}

Task<void> GcsClient::Pace(uint64_t bytes) {
  if (pacer_ == nullptr || bytes == 0) co_return;
  const Clock::duration wait = pacer_->Reserve(Clock::now(), bytes);
  if (wait <= Clock::duration::zero()) co_return;
  Status slept = co_await loop_.Sleep(std::chrono::ceil<std::chrono::milliseconds>(wait));
  slept.IgnoreError();
}

std::string GcsClient::ObjectUrl(const std::string& bucket, const std::string& name) const {
  return endpoint_ + "/storage/v1/b/" + UrlEncode(bucket) + "/o/" + UrlEncode(name);
}

std::string GcsClient::WithUserProject(std::string url) const {
  if (options_.user_project.empty()) return url;
  url += url.find('?') == std::string::npos ? '?' : '&';
  return url + "userProject=" + UrlEncode(options_.user_project);
}

Task<Status> GcsClient::Authorize(http::Request* r) {
  // Checked before a token is even fetched: over plain http anyone on the
  // path could read the token and use it for an hour.
  if (auth_.SendsCredentials() && !options_.allow_http_credentials && endpoint_.rfind("http://", 0) == 0) {
    co_return FailedPreconditionError(
        "refusing to send GCS credentials (" + auth_.Describe() + ") over plain http to " + endpoint_ +
        ": use an https:// endpoint, set STORAGE_EMULATOR_HOST for an emulator (which gets no credentials), or "
        "set gcs.allow_http_credentials to true if the path to this endpoint is trusted");
  }
  auto header = co_await auth_.Header();
  if (!header.ok()) co_return header.status().WithContext("cannot authenticate to GCS with " + auth_.Describe());
  if (!header->empty()) r->headers.push_back(std::move(*header));
  for (const auto& [k, v] : options_.headers) r->headers.push_back(k + ": " + v);
  co_return Status::Ok();
}

std::vector<std::string> GcsClient::Secrets() const {
  std::vector<std::string> out = auth_.Secrets();
  for (const auto& [name, value] : options_.headers) {
    if (base::LooksLikeCredential(value)) out.push_back(value);
  }
  return out;
}

Task<Result<http::Response>> GcsClient::Call(std::string what, const std::function<http::Request()>& make,
                                             std::optional<Clock::time_point> until) {
  Backoff backoff(options_.retry);
  bool refreshed = false;
  for (;;) {
    http::Request r = make();
    Status authorized = co_await Authorize(&r);  // a token fetch, if any, counts against `until` too
    if (!authorized.ok()) co_return std::move(authorized).WithContext(what);
    if (until) {
      const auto left = std::chrono::ceil<std::chrono::milliseconds>(*until - Clock::now());
      if (left.count() <= 0) {
        co_return DeadlineExceededError(what + ": no time left to send " + r.method + " " +
                                        r.url.substr(0, r.url.find('?')) + ": gcs.retry.deadline (" +
                                        std::to_string(options_.retry.deadline.count()) + " ms) reached");
      }
      r.time_limit = left;
    }
    ++stats_.requests;
    auto resp = co_await http_.Send(std::move(r));
    Outcome o = Classify(resp, what, Secrets());
    if (o.status.ok()) co_return resp;
    if (o.unauthorized && !refreshed) {
      auth_.Invalidate();  // one fresh token, then a 401 is final
      refreshed = true;
      continue;
    }
    std::chrono::milliseconds delay{0};
    if (!o.retryable) co_return o.status;
    if (!backoff.Next(&delay)) co_return GaveUp(std::move(o.status), backoff);
    ++stats_.retries;
    Status slept = co_await loop_.Sleep(delay);
    slept.IgnoreError();
  }
}

Task<Result<ObjectMeta>> GcsClient::Stat(std::string bucket, std::string name) {
  const std::string what = "stat " + GsUrl(bucket, name);
  std::string url = WithUserProject(ObjectUrl(bucket, name));
  auto make = [&url] {
    http::Request r;
    r.url = url;
    return r;
  };
  CO_ASSIGN_OR_RETURN(http::Response resp, co_await Call(what, make, MetadataDeadline()));
  co_return ParseObjectBody(resp, what);
}

Task<Status> GcsClient::Read(std::string bucket, std::string name, uint64_t offset, size_t len, char* dst,
                             uint64_t object_size, uint32_t* crc) {
  if (len == 0) {
    if (crc != nullptr) *crc = 0;
    co_return Status::Ok();
  }
  const std::string what = "read " + GsUrl(bucket, name);
  std::string url = WithUserProject(ObjectUrl(bucket, name) + "?alt=media");
  const bool whole = offset == 0 && len == object_size;
  auto make = [&] {
    http::Request r;
    r.url = url;
    if (!whole) r.headers = {"Range: bytes=" + std::to_string(offset) + "-" + std::to_string(offset + len - 1)};
    r.response_buffer = dst;
    r.response_capacity = len;
    if (crc != nullptr) {
      *crc = 0;  // each attempt writes dst from its start
      r.on_body = [crc](const char* data, size_t n) { *crc = format::Crc32cExtend(*crc, data, n); };
    }
    return r;
  };
  CO_ASSIGN_OR_RETURN(http::Response resp, co_await Call(what, make, std::nullopt));  // data: bounded by stalls
  if (resp.body_bytes != len) {
    co_return CorruptionError(what + ": wanted " + std::to_string(len) + " bytes at offset " + std::to_string(offset) +
                              ", got " + std::to_string(resp.body_bytes));
  }
  if (whole) {
    if (auto expected = GoogHashCrc(resp.Header("x-goog-hash"))) {
      uint32_t got = crc != nullptr ? *crc : format::Crc32c(dst, len);
      if (got != *expected) {
        co_return CorruptionError(what + ": the bytes read have CRC32C " + format::Crc32cToHex(got) +
                                  ", the server says " + format::Crc32cToHex(*expected));
      }
    }
  }
  co_return Status::Ok();
}

Task<Result<std::string>> GcsClient::ReadAll(std::string bucket, std::string name, uint64_t max_bytes) {
  // One GET (no metadata request first: small objects such as manifests and
  // fragments are read on every commit and restore), its length bounded as
  // it arrives, its CRC32C checked against x-goog-hash.
  const std::string what = "read " + GsUrl(bucket, name);
  std::string url = WithUserProject(ObjectUrl(bucket, name) + "?alt=media");
  const size_t limit = static_cast<size_t>(std::min<uint64_t>(max_bytes, SIZE_MAX - 1));
  auto make = [&] {
    http::Request r;
    r.url = url;
    r.max_body = std::max<size_t>(limit, size_t{1} << 20) + 1;  // room for an error's JSON body
    return r;
  };
  auto resp = co_await Call(what, make, MetadataDeadline());
  if (!resp.ok()) {
    if (resp.status().code() == StatusCode::kCorruption &&
        resp.status().message().find("longer than") != std::string::npos) {
      co_return CorruptionError(GsUrl(bucket, name) + ": more than the " + std::to_string(max_bytes) +
                                " bytes allowed");
    }
    co_return resp.status();
  }
  if (resp->body.size() > limit) {
    co_return CorruptionError(GsUrl(bucket, name) + ": " + std::to_string(resp->body.size()) +
                              " bytes, more than the " + std::to_string(max_bytes) + " bytes allowed");
  }
  if (auto expected = GoogHashCrc(resp->Header("x-goog-hash"))) {
    const uint32_t got = format::Crc32c(resp->body.data(), resp->body.size());
    if (got != *expected) {
      co_return CorruptionError(what + ": the bytes read have CRC32C " + format::Crc32cToHex(got) +
                                ", the server says " + format::Crc32cToHex(*expected));
    }
  }
  co_return std::move(resp->body);
}

Task<Result<ListResult>> GcsClient::List(std::string bucket, std::string prefix, std::string delimiter,
                                         int page_size) {
  const std::string what = "list " + GsUrl(bucket, prefix);
  const Clock::time_point until = MetadataDeadline();  // for every page together
  ListResult out;
  std::string page_token;
  do {
    std::string url = endpoint_ + "/storage/v1/b/" + UrlEncode(bucket) + "/o?prefix=" + UrlEncode(prefix) +
                      "&maxResults=" + std::to_string(page_size);
    if (!delimiter.empty()) url += "&delimiter=" + UrlEncode(delimiter);
    if (!page_token.empty()) url += "&pageToken=" + UrlEncode(page_token);
    url = WithUserProject(std::move(url));
    auto make = [&url] {
      http::Request r;
      r.url = url;
      return r;
    };
    CO_ASSIGN_OR_RETURN(http::Response resp, co_await Call(what, make, until));
    Json j = Json::parse(resp.body, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) co_return UnavailableError(what + ": the answer is not a JSON object");
    if (j.contains("items") && j["items"].is_array()) {
      for (const Json& item : j["items"]) {
        CO_ASSIGN_OR_RETURN(ObjectMeta m, ParseObject(item, what));
        out.objects.push_back(std::move(m));
      }
    }
    if (j.contains("prefixes") && j["prefixes"].is_array()) {
      for (const Json& p : j["prefixes"]) {
        if (p.is_string()) out.prefixes.push_back(p.get<std::string>());
      }
    }
    page_token = j.contains("nextPageToken") && j["nextPageToken"].is_string() ? j["nextPageToken"].get<std::string>()
                                                                                 : "";
    ++out.pages;
  } while (!page_token.empty());
  co_return out;
}

Task<Status> GcsClient::Delete(std::string bucket, std::string name) {
  std::string url = WithUserProject(ObjectUrl(bucket, name));
  auto make = [&url] {
    http::Request r;
    r.method = "DELETE";
    r.url = url;
    return r;
  };
  auto resp = co_await Call("delete " + GsUrl(bucket, name), make, MetadataDeadline());
  if (!resp.ok() && resp.status().code() != StatusCode::kNotFound) co_return resp.status();
  co_return Status::Ok();
}

}  // namespace ckptio::gcs
