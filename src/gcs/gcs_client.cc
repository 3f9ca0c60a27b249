#include "gcs/gcs_client.h"

#include <algorithm>
#include <charconv>
#include <nlohmann/json.hpp>

#include "base/status_macros.h"
#include "format/crc32c.h"
#include "gcs/gcs_url.h"
#include "gcs/retry.h"
#include "runtime/io_ops.h"
#include "base/redact.h"

namespace ckptio::gcs {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kChunkQuantum = 256 * 1024;  // GCS: non-final chunks are multiples of this

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

Result<ObjectMeta> ParseObjectBody(const http::Response& r, const std::string& what) {
  Json j = Json::parse(r.body, nullptr, /*allow_exceptions=*/false);
  return ParseObject(j, what);
}

// What the server says it stored against what we sent: the size, and the
// CRC32C (once known; REQUIRES: source->crc_ready, if any, is set).
Status CheckStored(const ObjectMeta& meta, const UploadSource* source, const std::string& what) {
  if (source->crc32c != nullptr && meta.crc32c && *meta.crc32c != *source->crc32c) {
    return CorruptionError(what + ": the server stored CRC32C " + format::Crc32cToHex(*meta.crc32c) +
                           " but the data has " + format::Crc32cToHex(*source->crc32c));
  }
  if (meta.size != source->size) {
    return CorruptionError(what + ": the server stored " + std::to_string(meta.size) + " bytes of " +
                           std::to_string(source->size));
  }
  return Status::Ok();
}

// The CRC32C the data has, if the caller gave one (REQUIRES: crc_ready, if
// any, is set).
std::optional<uint32_t> SourceCrc(const UploadSource* source) {
  if (source->crc32c == nullptr) return std::nullopt;
  return *source->crc32c;
}

// "bytes=0-N" -> N + 1; no header -> 0 (nothing persisted).
uint64_t CommittedBytes(const http::Response& r) {
  std::string_view range = r.Header("range");
  size_t dash = range.find('-');
  if (range.rfind("bytes=", 0) != 0 || dash == std::string_view::npos) return 0;
  uint64_t last = 0;
  std::from_chars(range.data() + dash + 1, range.data() + range.size(), last);
  return last + 1;
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

// The pieces of `source` covering [offset, offset + len).
std::vector<http::BodyPiece> Slice(const UploadSource* source, uint64_t offset, uint64_t len) {
  std::vector<http::BodyPiece> out;
  uint64_t base = 0;
  for (const http::BodyPiece& p : source->pieces) {
    uint64_t end = base + p.len;
    if (end > offset && base < offset + len) {
      uint64_t from = std::max(base, offset);
      uint64_t to = std::min(end, offset + len);
      out.push_back({p.data + (from - base), static_cast<size_t>(to - from)});
    }
    base = end;
  }
  return out;
}

// The last error, with how long we tried: "... (gave up after 6 attempts ...)".
Status GaveUp(Status last, const Backoff& backoff) {
  return Status(last.code(), last.message() + " (" + backoff.Exhausted() + ")", last.sys_errno());
}

}  // namespace

std::string GsUrl(const std::string& bucket, const std::string& name) { return "gs://" + bucket + "/" + name; }

GcsClient::GcsClient(runtime::Loop& loop, http::HttpClient& http, AuthProvider& auth, std::string endpoint,
                     Options::Gcs options)
    : loop_(loop), http_(http), auth_(auth), endpoint_(std::move(endpoint)), options_(std::move(options)) {
  while (!endpoint_.empty() && endpoint_.back() == '/') endpoint_.pop_back();
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

Task<Result<std::string>> GcsClient::StartSession(const std::string& bucket, const std::string& name,
                                                  const UploadSource* source, const std::string& what) {
  std::string url = WithUserProject(endpoint_ + "/upload/storage/v1/b/" + UrlEncode(bucket) +
                                    "/o?uploadType=resumable&name=" + UrlEncode(name));
  auto make = [&url, source] {
    http::Request r;
    r.method = "POST";
    r.url = url;
    r.headers = {"Content-Type: application/json; charset=UTF-8", "X-Upload-Content-Type: application/octet-stream",
                 "X-Upload-Content-Length: " + std::to_string(source->size)};
    r.body = "{}";
    return r;
  };
  CO_ASSIGN_OR_RETURN(http::Response resp, co_await Call("start " + what, make, MetadataDeadline()));
  std::string_view location = resp.Header("location");
  if (location.empty()) co_return UnavailableError("start " + what + ": the answer has no Location header");
  co_return std::string(location);
}

Task<Result<http::Response>> GcsClient::SendChunk(const std::string& session, const UploadSource* source,
                                                  uint64_t offset, uint64_t len, bool last) {
  http::Request r;
  r.method = "PUT";
  r.url = session;
  std::string range = len == 0 ? "bytes */" : "bytes " + std::to_string(offset) + "-" + std::to_string(offset + len - 1) + "/";
  r.headers = {"Content-Type: application/octet-stream",
               "Content-Range: " + range + (last ? std::to_string(source->size) : "*")};
  if (last && source->crc32c != nullptr) {
    r.headers.push_back("x-goog-hash: crc32c=" + format::Crc32cToBase64(*source->crc32c));
  }
  r.pieces = Slice(source, offset, len);
  CO_TRY(co_await Authorize(&r));
  ++stats_.requests;
  stats_.bytes_uploaded += len;
  co_return co_await http_.Send(std::move(r));
}

Task<Result<http::Response>> GcsClient::QuerySession(const std::string& session, uint64_t total) {
  http::Request r;
  r.method = "PUT";
  r.url = session;
  r.headers = {"Content-Range: bytes */" + std::to_string(total)};
  CO_TRY(co_await Authorize(&r));
  ++stats_.requests;
  co_return co_await http_.Send(std::move(r));
}

Task<Result<ObjectMeta>> GcsClient::ConfirmStored(std::string bucket, std::string name, uint64_t size,
                                                  std::optional<uint32_t> crc, std::string what) {
  const std::string url = GsUrl(bucket, name);
  const std::string broken = what + ": the server answered with success, but its answer is not an object resource";
  auto meta = co_await Stat(bucket, name);
  if (meta.status().code() == StatusCode::kNotFound) {
    co_return UnavailableError(broken + ", and " + url + " does not exist: the upload did not complete; save again");
  }
  if (!meta.ok()) co_return meta.status().WithContext(broken + "; checking what " + url + " holds");
  const bool crc_matches = !crc || !meta->crc32c || *meta->crc32c == *crc;
  if (meta->size == size && crc_matches) co_return meta;
  const auto crc_text = [](std::optional<uint32_t> c) { return c ? " with CRC32C " + format::Crc32cToHex(*c) : ""; };
  co_return CorruptionError(broken + ", and " + url + " holds " + std::to_string(meta->size) + " bytes" +
                            crc_text(meta->crc32c) + ", not the " + std::to_string(size) + " bytes" + crc_text(crc) +
                            " this upload sent: the object there is not ours");
}

Task<Result<ObjectMeta>> GcsClient::UploadOnce(std::string bucket, std::string name, const UploadSource* source) {
  const std::string what = "upload " + GsUrl(bucket, name);
  std::string url = WithUserProject(endpoint_ + "/upload/storage/v1/b/" + UrlEncode(bucket) +
                                    "/o?uploadType=media&name=" + UrlEncode(name));
  // The CRC32C goes with the bytes if it is known by now (the server then
  // refuses bytes that do not match); either way the CRC the server stored
  // is checked against ours below, before anything can commit this object.
  const bool crc_known = source->crc32c != nullptr && (source->crc_ready == nullptr || source->crc_ready->is_set());
  auto make = [&url, source, crc_known] {
    http::Request r;
    r.method = "POST";
    r.url = url;
    r.headers = {"Content-Type: application/octet-stream"};
    if (crc_known) r.headers.push_back("x-goog-hash: crc32c=" + format::Crc32cToBase64(*source->crc32c));
    r.pieces = Slice(source, 0, source->size);
    return r;
  };
  stats_.bytes_uploaded += source->size;
  CO_ASSIGN_OR_RETURN(http::Response resp, co_await Call(what, make, std::nullopt));  // data: bounded by stalls
  if (source->crc_ready != nullptr) co_await source->crc_ready->Wait();
  Result<ObjectMeta> parsed = ParseObjectBody(resp, what);
  if (!parsed.ok()) {
    const std::optional<uint32_t> crc = SourceCrc(source);
    parsed = co_await ConfirmStored(bucket, name, source->size, crc, what);
  }
  CO_ASSIGN_OR_RETURN(ObjectMeta meta, std::move(parsed));
  CO_TRY(CheckStored(meta, source, what));
  if (source->progress != nullptr) source->progress->fetch_add(source->size, std::memory_order_relaxed);
  co_return meta;
}

// A resumable upload in progress: the session and what the server has.
struct GcsClient::ResumableUpload {
  ResumableUpload(std::string b, std::string n, const UploadSource* s, const Options::Gcs::Retry& retry)
      : bucket(std::move(b)), name(std::move(n)), what("upload " + GsUrl(bucket, name)), source(s),
        backoff(retry) {}
  const std::string bucket;
  const std::string name;
  const std::string what;
  const UploadSource* source;
  Backoff backoff;
  std::string session;     // the session URI; empty: none yet
  uint64_t committed = 0;  // bytes the server has persisted
  uint64_t sent_end = 0;   // end of what has been sent (a resend counts as such)
  uint64_t reported = 0;   // acknowledged bytes added to source->progress so far
  bool refreshed = false;  // the token was refreshed once after a 401
  Result<http::Response> resp = UnavailableError("no request sent");  // the last answer
  Outcome failure;         // the last answer, classified

  // source->progress may be shared by several uploads: add what is new.
  void Report(uint64_t acknowledged) {
    if (source->progress == nullptr || acknowledged <= reported) return;
    source->progress->fetch_add(acknowledged - reported, std::memory_order_relaxed);
    reported = acknowledged;
  }
};

// The resumable-upload protocol, one state at a time:
//   kSession  POST ...?uploadType=resumable -> the session URI      -> kSend from 0
//   kSend     PUT the chunk at `committed`:  308 + Range          -> kSend from there
//                                            200/201              -> kDone
//                                            failure              -> kRecover
//   kRecover  after a failure: a 401 refreshes the token (once);
//             404/410 (the session expired or vanished)           -> kSession
//             retryable: back off (or give up)                    -> kQuery
//             anything else                                       -> the error
//   kQuery    PUT bytes */total: what has the server persisted?
//                                            308 + Range          -> kSend (only what is missing)
//                                            200/201              -> kDone (the last chunk landed)
//                                            failure              -> kRecover
//   kDone     the object resource: size and CRC32C must be ours (an answer
//             that says 200 but is broken is settled by what the bucket holds)
Task<Result<ObjectMeta>> GcsClient::Upload(std::string bucket, std::string name, const UploadSource* source) {
  const uint64_t chunk = std::max(kChunkQuantum, options_.chunk_size / kChunkQuantum * kChunkQuantum);
  // What fits one chunk goes in one request: a resumable session would cost
  // a round trip more and send the same single chunk. (An empty object keeps
  // the session: a POST without a body is not worth a special case.)
  if (source->size > 0 && source->size <= chunk) {
    co_return co_await UploadOnce(std::move(bucket), std::move(name), source);
  }
  ResumableUpload u(std::move(bucket), std::move(name), source, options_.retry);
  using State = UploadState;
  State state = State::kSession;
  while (state != State::kDone) {
    switch (state) {
      case State::kSession: {
        CO_ASSIGN_OR_RETURN(u.session, co_await StartSession(u.bucket, u.name, source, u.what));
        u.committed = 0;
        state = State::kSend;
        break;
      }
      case State::kSend: {
        const uint64_t len = std::min(chunk, source->size - u.committed);
        const bool last = u.committed + len == source->size;
        if (last && source->crc_ready != nullptr) co_await source->crc_ready->Wait();  // sent with the last bytes
        if (u.committed < u.sent_end) stats_.bytes_resent += std::min(u.sent_end, u.committed + len) - u.committed;
        u.resp = co_await SendChunk(u.session, source, u.committed, len, last);
        u.sent_end = std::max(u.sent_end, u.committed + len);
        state = AfterAnswer(&u);
        break;
      }
      case State::kRecover: {
        if (u.failure.unauthorized && !u.refreshed) {
          auth_.Invalidate();
          u.refreshed = true;
          state = State::kQuery;
        } else if (u.resp.ok() && (u.resp->status == 404 || u.resp->status == 410)) {
          ++stats_.sessions_restarted;  // the session expired or vanished: start over
          u.session.clear();
          state = State::kSession;
        } else {
          std::chrono::milliseconds delay{0};
          if (!u.failure.retryable) co_return u.failure.status;
          if (!u.backoff.Next(&delay)) co_return GaveUp(std::move(u.failure.status), u.backoff);
          ++stats_.retries;
          Status slept = co_await loop_.Sleep(delay);
          slept.IgnoreError();
          state = State::kQuery;
        }
        break;
      }
      case State::kQuery: {
        u.resp = co_await QuerySession(u.session, source->size);
        state = AfterAnswer(&u);
        break;
      }
      case State::kDone:
        break;
    }
  }
  Result<ObjectMeta> parsed = ParseObjectBody(*u.resp, u.what);
  if (!parsed.ok()) {
    const std::optional<uint32_t> crc = SourceCrc(source);
    parsed = co_await ConfirmStored(u.bucket, u.name, source->size, crc, u.what);
  }
  CO_ASSIGN_OR_RETURN(ObjectMeta meta, std::move(parsed));
  CO_TRY(CheckStored(meta, source, u.what));
  u.Report(source->size);
  co_return meta;
}

// What a chunk's or a query's answer leads to: 308 -> send from what the
// server has; 200/201 -> done; anything else -> recover.
GcsClient::UploadState GcsClient::AfterAnswer(ResumableUpload* u) {
  u->failure = Classify(u->resp, u->what, Secrets());
  if (!u->failure.status.ok()) return UploadState::kRecover;
  if (u->resp->status != 308) return UploadState::kDone;
  u->committed = CommittedBytes(*u->resp);
  u->Report(u->committed);
  return UploadState::kSend;
}

Task<Result<ObjectMeta>> GcsClient::UploadSmall(std::string bucket, std::string name, std::string body,
                                                std::optional<int64_t> if_generation_match) {
  const std::string what = "upload " + GsUrl(bucket, name);
  std::string url = endpoint_ + "/upload/storage/v1/b/" + UrlEncode(bucket) + "/o?uploadType=media&name=" +
                    UrlEncode(name);
  if (if_generation_match) url += "&ifGenerationMatch=" + std::to_string(*if_generation_match);
  url = WithUserProject(std::move(url));
  const uint32_t crc = format::Crc32c(body.data(), body.size());
  int attempts = 0;
  auto make = [&] {
    ++attempts;
    http::Request r;
    r.method = "POST";
    r.url = url;
    r.headers = {"Content-Type: application/octet-stream", "x-goog-hash: crc32c=" + format::Crc32cToBase64(crc)};
    r.pieces = {{body.data(), body.size()}};
    return r;
  };
  auto resp = co_await Call(what, make, MetadataDeadline());
  if (!resp.ok() && resp.status().code() == StatusCode::kAlreadyExists && attempts > 1) {
    // A retry after a lost answer finds the object our first attempt made:
    // it is ours if its bytes are.
    auto meta = co_await Stat(bucket, name);
    if (meta.ok() && meta->crc32c == crc && meta->size == body.size()) co_return meta;
  }
  if (!resp.ok()) co_return resp.status();
  Result<ObjectMeta> parsed = ParseObjectBody(*resp, what);
  if (!parsed.ok()) {
    // Committed, but the answer is broken: ours if the bytes are.
    const std::optional<uint32_t> known_crc = crc;
    parsed = co_await ConfirmStored(bucket, name, body.size(), known_crc, what);
  }
  co_return parsed;
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
                             uint64_t object_size) {
  if (len == 0) co_return Status::Ok();
  const std::string what = "read " + GsUrl(bucket, name);
  std::string url = WithUserProject(ObjectUrl(bucket, name) + "?alt=media");
  const bool whole = offset == 0 && len == object_size;
  auto make = [&] {
    http::Request r;
    r.url = url;
    if (!whole) r.headers = {"Range: bytes=" + std::to_string(offset) + "-" + std::to_string(offset + len - 1)};
    r.response_buffer = dst;
    r.response_capacity = len;
    return r;
  };
  CO_ASSIGN_OR_RETURN(http::Response resp, co_await Call(what, make, std::nullopt));  // data: bounded by stalls
  if (resp.body_bytes != len) {
    co_return CorruptionError(what + ": wanted " + std::to_string(len) + " bytes at offset " + std::to_string(offset) +
                              ", got " + std::to_string(resp.body_bytes));
  }
  if (whole) {
    if (auto expected = GoogHashCrc(resp.Header("x-goog-hash"))) {
      uint32_t got = format::Crc32c(dst, len);
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
