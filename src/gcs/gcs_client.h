#pragma once
// GcsClient: the GCS JSON API calls ckptio needs, with retries.
//
// Every call retries 408, 429, 5xx, connection resets and timeouts with
// capped exponential backoff and full jitter (gcs.retry), refreshes the token
// once after a 401, and fails fast on anything else with the server's own
// error message (credentials redacted). Uploads of large objects are
// resumable: chunks of gcs.chunk_size, and after any failure the session is
// queried and only the bytes the server does not have are sent again. A
// metadata call (list, stat, delete, small reads and uploads) ends within
// gcs.retry.deadline, retries included, even if the endpoint never answers.
//
// Threads: loop thread only. Buffers stay owned by the caller until the call
// finishes.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckptio/options.h"
#include "ckptio/status.h"
#include "runtime/task.h"
#include "gcs/auth.h"
#include "gcs/pacer.h"
#include "http/http_client.h"
#include "runtime/async_sync.h"
#include "runtime/loop.h"

namespace ckptio::gcs {

struct ObjectMeta {
  std::string name;
  uint64_t size = 0;
  std::optional<uint32_t> crc32c;
  int64_t generation = 0;
};

struct ListResult {
  std::vector<ObjectMeta> objects;
  std::vector<std::string> prefixes;  // with the delimiter, when one was given
  int pages = 0;
};

// Written on the loop thread; read from any (relaxed atomics).
struct GcsStats {
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> retries{0};
  std::atomic<uint64_t> bytes_uploaded{0};     // chunk bytes sent, including resends
  std::atomic<uint64_t> bytes_resent{0};       // of which sent again after a failure
  std::atomic<uint64_t> sessions_restarted{0};  // 404/410 on a session
  // Sessions of an earlier process taken up again (UploadSource::resume_session),
  // and the bytes the server already had from it, not sent again.
  std::atomic<uint64_t> sessions_resumed{0};
  std::atomic<uint64_t> bytes_resumed{0};
};

// The bytes of an object to upload: pieces in order (the caller's buffers).
struct UploadSource {
  std::vector<http::BodyPiece> pieces;
  uint64_t size = 0;
  // The object's CRC32C, valid once *crc_ready is set (null: already valid,
  // or crc32c null for none). Sent with the last chunk for the server to
  // check; the CRC the server computed is checked against it.
  const uint32_t* crc32c = nullptr;
  runtime::AsyncEvent* crc_ready = nullptr;
  std::atomic<uint64_t>* progress = nullptr;  // bytes the server acknowledged are added here
  // Uploads that survive a restart: a resumable session an earlier process
  // started for these same bytes. It is asked what it has and only the rest
  // is sent; one that expired, was not started at this endpoint or answers
  // with an error is replaced by a new session.
  std::string resume_session;
  // Called with each new session's URI before any byte is sent to it (an
  // error fails the upload): where the caller records it durably.
  std::function<Status(const std::string& session)> on_session;
};

class GcsClient {
 public:
  // endpoint: "https://storage.googleapis.com" or an emulator's URL.
  // With options.max_upload_bandwidth, the uploads are paced by `pacer`
  // (shared by the clients of one root), or by one of this client's own.
  GcsClient(runtime::Loop& loop, http::HttpClient& http, AuthProvider& auth, std::string endpoint,
            Options::Gcs options, std::shared_ptr<UploadPacer> pacer = nullptr);

  // An object of any size: one request when it fits a chunk, else a
  // resumable upload in chunks. (Here and in UploadSmall, a success whose
  // answer is broken is settled by StoredObject.)
  Task<Result<ObjectMeta>> Upload(std::string bucket, std::string name, const UploadSource* source);
  // A small object in one request; if_generation_match=0 makes it fail with
  // AlreadyExists if the object exists (the commit of a manifest).
  Task<Result<ObjectMeta>> UploadSmall(std::string bucket, std::string name, std::string body,
                                       std::optional<int64_t> if_generation_match);
  // NotFound if there is no such object.
  Task<Result<ObjectMeta>> Stat(std::string bucket, std::string name);
  // Reads [offset, offset+len) into dst. A read of the whole object is
  // checked against the x-goog-hash the server sends. With `crc`: sets it
  // to the CRC32C of the bytes read, taken as they arrive.
  Task<Status> Read(std::string bucket, std::string name, uint64_t offset, size_t len, char* dst,
                    uint64_t object_size, uint32_t* crc = nullptr);
  // Reads a whole object of at most max_bytes.
  Task<Result<std::string>> ReadAll(std::string bucket, std::string name, uint64_t max_bytes);
  // Every page of objects under prefix (page_size objects per request).
  Task<Result<ListResult>> List(std::string bucket, std::string prefix, std::string delimiter,
                                int page_size = 1000);
  // Deletes an object; one that does not exist counts as deleted.
  Task<Status> Delete(std::string bucket, std::string name);

  const GcsStats& stats() const { return stats_; }
  const std::string& endpoint() const { return endpoint_; }

 private:
  // A resumable upload's states and progress (Upload, gcs_client.cc).
  enum class UploadState { kSession, kSend, kRecover, kQuery, kDone };
  struct ResumableUpload;
  UploadState AfterAnswer(ResumableUpload* u);
  using Clock = std::chrono::steady_clock;
  // Sends a request built by `make` with retries; `what` names it in errors.
  // With `until` (a metadata operation: list, stat, delete, small reads and
  // uploads), the whole call ends by then, attempts included: each attempt
  // gets what is left as its time limit, so an endpoint that accepts and
  // never answers costs gcs.retry.deadline, not max_attempts stalls. Without
  // (a data transfer), an attempt ends when it stalls for
  // gcs.timeouts.stall, and retries stop at gcs.retry.deadline.
  Task<Result<http::Response>> Call(std::string what, const std::function<http::Request()>& make,
                                    std::optional<Clock::time_point> until);
  // Now + gcs.retry.deadline: when a metadata operation starting now ends.
  Clock::time_point MetadataDeadline() const { return Clock::now() + options_.retry.deadline; }
  // One request (uploadType=media); the stored CRC32C is checked after.
  Task<Result<ObjectMeta>> UploadOnce(std::string bucket, std::string name, const UploadSource* source);
  Task<Result<std::string>> StartSession(const std::string& bucket, const std::string& name,
                                         const UploadSource* source, const std::string& what);
  Task<Result<http::Response>> SendChunk(const std::string& session, const UploadSource* source,
                                         uint64_t offset, uint64_t len, bool last);
  Task<Result<http::Response>> QuerySession(const std::string& session, uint64_t total);
  // Waits until gcs.max_upload_bandwidth allows `bytes` more.
  Task<void> Pace(uint64_t bytes);
  // A request's own cap on its send rate (http::Request::max_send_speed).
  uint64_t SendCap() const { return pacer_ ? pacer_->rate() : 0; }
  // The object that `answer`, a 2xx completing an upload, describes. When
  // its body is not an object resource (a stream broken after the server
  // committed), the object is ours iff the bucket holds `size` bytes with
  // CRC32C `crc` (when known) under `name`: its metadata if so, else an error
  // that says what is there. `answer` is read before the first suspension
  // (callers await this in the same full expression).
  Task<Result<ObjectMeta>> StoredObject(const http::Response* answer, std::string bucket, std::string name,
                                        uint64_t size, std::optional<uint32_t> crc, std::string what);
  Task<Status> Authorize(http::Request* r);
  // What the requests carry that no error may show: the tokens, and the
  // configured header values that look like credentials.
  std::vector<std::string> Secrets() const;
  std::string ObjectUrl(const std::string& bucket, const std::string& name) const;
  std::string WithUserProject(std::string url) const;

  runtime::Loop& loop_;
  http::HttpClient& http_;
  AuthProvider& auth_;
  std::string endpoint_;
  Options::Gcs options_;
  std::shared_ptr<UploadPacer> pacer_;  // null: no cap
  GcsStats stats_;
};

// gs://bucket/name for messages.
std::string GsUrl(const std::string& bucket, const std::string& name);

}  // namespace ckptio::gcs
