// GcsClient's uploads: the resumable-upload protocol (session, chunks,
// recovery by query, confirmation by the stored object) and one-request
// uploads. The client's other calls are in gcs_client.cc.
#include <algorithm>
#include <charconv>

#include "base/status_macros.h"
#include "format/crc32c.h"
#include "gcs/gcs_client.h"
#include "gcs/gcs_client_internal.h"
#include "gcs/gcs_url.h"
#include "gcs/retry.h"
#include "runtime/io_ops.h"

namespace ckptio::gcs {
namespace {

using internal::GaveUp;
using internal::ParseObjectBody;

constexpr uint64_t kChunkQuantum = 256 * 1024;  // GCS: non-final chunks are multiples of this

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

}  // namespace

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
  r.max_send_speed = SendCap();
  co_await Pace(len);
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

Task<Result<ObjectMeta>> GcsClient::StoredObject(const http::Response* answer, std::string bucket,
                                                 std::string name, uint64_t size, std::optional<uint32_t> crc,
                                                 std::string what) {
  Result<ObjectMeta> parsed = ParseObjectBody(*answer, what);
  if (parsed.ok()) co_return parsed;
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
  auto make = [this, &url, source, crc_known] {
    http::Request r;
    r.method = "POST";
    r.url = url;
    r.max_send_speed = SendCap();
    r.headers = {"Content-Type: application/octet-stream"};
    if (crc_known) r.headers.push_back("x-goog-hash: crc32c=" + format::Crc32cToBase64(*source->crc32c));
    r.pieces = Slice(source, 0, source->size);
    return r;
  };
  stats_.bytes_uploaded += source->size;
  co_await Pace(source->size);
  CO_ASSIGN_OR_RETURN(http::Response resp, co_await Call(what, make, std::nullopt));  // data: bounded by stalls
  if (source->crc_ready != nullptr) co_await source->crc_ready->Wait();
  CO_ASSIGN_OR_RETURN(ObjectMeta meta,
                      co_await StoredObject(&resp, bucket, name, source->size, SourceCrc(source), what));
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
  bool resumed = false;    // `session` is an earlier process's, not yet answered
  std::optional<ObjectMeta> confirmed;  // an earlier process's upload, complete: what the bucket holds
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
//   (start)   an earlier process's session (source->resume_session)  -> kQuery
//             else                                                   -> kSession
//   kSession  POST ...?uploadType=resumable -> the session URI,
//             recorded by source->on_session                      -> kSend from 0
//   kSend     PUT the chunk at `committed`:  308 + Range          -> kSend from there
//                                            200/201              -> kDone
//                                            failure              -> kRecover
//   kRecover  after a failure: a 401 refreshes the token (once);
//             404/410 (the session expired or vanished), or any
//             other error from an earlier process's session       -> kSession
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
  // Only a session of this endpoint is asked (its URI is where the bytes go).
  if (!source->resume_session.empty() && source->resume_session.rfind(endpoint_ + "/", 0) == 0) {
    u.session = source->resume_session;
    u.resumed = true;
    state = State::kQuery;
  }
  while (state != State::kDone) {
    switch (state) {
      case State::kSession: {
        CO_ASSIGN_OR_RETURN(u.session, co_await StartSession(u.bucket, u.name, source, u.what));
        u.committed = 0;
        u.resumed = false;
        if (source->on_session) CO_TRY(source->on_session(u.session).WithContext(u.what));
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
        } else if ((u.resp.ok() && (u.resp->status == 404 || u.resp->status == 410)) ||
                   (u.resumed && !u.failure.retryable)) {
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
        if (u.resumed && state != State::kRecover) {
          // An earlier process's session answered: what it sent is not sent
          // again. If it completed the object, the object must still be there.
          u.resumed = false;
          if (state == State::kDone) {
            auto meta = co_await Stat(u.bucket, u.name);
            if (meta.status().code() == StatusCode::kNotFound) {
              ++stats_.sessions_restarted;
              u.session.clear();
              state = State::kSession;
              break;
            }
            if (!meta.ok()) co_return meta.status().WithContext(u.what);
            u.confirmed = std::move(meta).value();
          }
          ++stats_.sessions_resumed;
          stats_.bytes_resumed += state == State::kDone ? source->size : u.committed;
        }
        break;
      }
      case State::kDone:
        break;
    }
  }
  if (source->crc_ready != nullptr) co_await source->crc_ready->Wait();  // (set already, unless resumed)
  ObjectMeta meta;
  if (u.confirmed) {
    meta = std::move(*u.confirmed);
  } else {
    CO_ASSIGN_OR_RETURN(meta,
                        co_await StoredObject(&*u.resp, u.bucket, u.name, source->size, SourceCrc(source), u.what));
  }
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
  co_return co_await StoredObject(&*resp, bucket, name, body.size(), crc, what);
}

}  // namespace ckptio::gcs
