#include "storage/gcs_storage.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <vector>

#include "base/status_macros.h"
#include "runtime/when_all.h"
#include "gcs/auth.h"
#include "gcs/gcs_client.h"
#include "gcs/gcs_url.h"
#include "http/http_client.h"
#include "runtime/loop.h"

namespace ckptio::storage {
namespace {

using gcs::GcsClient;
using gcs::GsUrl;

constexpr const char* kManifest = "manifest.json";

class GcsStorage;

class GcsWriter final : public CheckpointWriter {
 public:
  GcsWriter(GcsStorage* storage, std::string name) : storage_(storage), name_(std::move(name)) {}
  Task<Status> WriteFile(const FileImage* image) override;
  Task<Status> WriteSmall(std::string name, std::string bytes) override;
  Task<Result<std::string>> ReadSmall(std::string name, uint64_t max_bytes) override;
  Task<Status> Commit(std::string manifest_json) override;
  Task<Status> Abort() override;

 private:
  GcsStorage* storage_;
  std::string name_;
  std::vector<std::string> uploaded_;  // objects to delete on Abort
};

// One event loop that carries transfers, with its own connections, token and
// client. Lane 0 runs on the manager's loop; the others each on a thread of
// their own (gcs.loops), so TLS and HTTP work spread over the cores. A lane's
// objects are created, used and destroyed on its loop's thread only.
struct Lane {
  Lane() = default;
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  // A lane on a thread of its own drops its clients there (they hold polls
  // and timers in its ring), then the thread stops. Lane 0's are destroyed
  // here, on the manager's loop thread, in member order.
  ~Lane();

  std::unique_ptr<runtime::LoopThread> thread;  // null for lane 0
  runtime::Loop* loop = nullptr;
  std::unique_ptr<http::HttpClient> http;
  std::unique_ptr<gcs::AuthProvider> auth;
  std::unique_ptr<GcsClient> client;
};

Task<void> DropClients(Lane* lane) {
  lane->client.reset();
  lane->auth.reset();
  lane->http.reset();
  co_return;
}

Lane::~Lane() {
  if (thread != nullptr) thread->loop().BlockOn(DropClients(this));
}

// Creates the lane's clients; runs on the lane's loop.
Task<Status> MakeClients(Lane* lane, http::HttpOptions ho, Options::Gcs options, bool emulator, std::string endpoint,
                         std::shared_ptr<gcs::UploadPacer> pacer) {
  CO_ASSIGN_OR_RETURN(lane->http, http::HttpClient::Create(*lane->loop, ho));
  CO_ASSIGN_OR_RETURN(lane->auth, gcs::MakeAuth(*lane->loop, *lane->http, options, emulator));
  lane->client = std::make_unique<GcsClient>(*lane->loop, *lane->http, *lane->auth, endpoint, options, pacer);
  co_return Status::Ok();
}

class GcsReadable final : public ReadableFile {
 public:
  GcsReadable(GcsStorage* storage, std::string bucket, std::string object, uint64_t size)
      : storage_(storage), bucket_(std::move(bucket)), object_(std::move(object)), size_(size) {}
  uint64_t size() const override { return size_; }
  Task<Status> ReadAt(uint64_t offset, char* dst, size_t len) override { return ReadAtCrc(offset, dst, len, nullptr); }
  // Each block of the response is checksummed as it arrives, in cache.
  bool ChecksumsWhileReading() const override { return true; }
  Task<Status> ReadAtCrc(uint64_t offset, char* dst, size_t len, uint32_t* crc) override;

 private:
  GcsStorage* storage_;
  std::string bucket_;
  std::string object_;
  uint64_t size_;
};

class GcsStorage final : public Storage {
 public:
  // lanes[0] runs on the manager's loop and serves everything but the bulk
  // transfers (which go round-robin over all lanes).
  GcsStorage(std::string root, gcs::GcsPath path, std::vector<std::unique_ptr<Lane>> lanes)
      : root_(std::move(root)), path_(std::move(path)), lanes_(std::move(lanes)), client_(lanes_[0]->client.get()) {}

  const std::string& root() const override { return root_; }
  Task<Result<std::vector<Entry>>> List() override;
  Task<Result<std::unique_ptr<CheckpointWriter>>> StartCheckpoint(std::string name, bool replace,
                                                                 bool shared) override;
  Task<Result<std::string>> ReadSmallFile(std::string checkpoint, std::string file, uint64_t max_bytes) override;
  Task<Result<std::unique_ptr<ReadableFile>>> OpenFile(std::string checkpoint, std::string file) override;
  Task<Status> Remove(std::string name) override;
  Task<Status> RemoveExcept(std::string name, std::vector<std::string> keep) override;
  Status LockForWriting() override { return Status::Ok(); }
  uint64_t retries() const override {
    uint64_t n = 0;
    for (const auto& lane : lanes_) n += lane->client->stats().retries;
    return n;
  }
  uint64_t bytes_resumed() const override {
    uint64_t n = 0;
    for (const auto& lane : lanes_) n += lane->client->stats().bytes_resumed;
    return n;
  }
  uint64_t requests() const override {
    uint64_t n = 0;
    for (const auto& lane : lanes_) n += lane->client->stats().requests;
    return n;
  }

  GcsClient& client() { return *client_; }
  // The lane for the next bulk transfer (loop thread only).
  Lane& NextLane() { return *lanes_[next_lane_++ % lanes_.size()]; }
  const std::string& bucket() const { return path_.bucket; }
  // "prefix/" or "" : what every object name of this root starts with.
  std::string Base() const { return path_.prefix.empty() ? "" : path_.prefix + "/"; }
  std::string Object(const std::string& checkpoint, const std::string& file) const {
    return Base() + checkpoint + "/" + file;
  }

 private:
  std::string root_;
  gcs::GcsPath path_;
  std::vector<std::unique_ptr<Lane>> lanes_;
  GcsClient* client_;  // lanes_[0]'s
  size_t next_lane_ = 0;
};

// Sets an event on the loop this runs on.
Task<void> SetEvent(runtime::AsyncEvent* event) {
  event->Set();
  co_return;
}

// Sets `to` (an event of `loop`) once `from` (an event of this loop) is set.
Task<void> ForwardEvent(runtime::AsyncEvent* from, runtime::Loop* loop, runtime::AsyncEvent* to) {
  co_await from->Wait();
  co_await runtime::OnLoop(*loop, SetEvent(to));
}

Task<Status> GcsReadable::ReadAtCrc(uint64_t offset, char* dst, size_t len, uint32_t* crc) {
  if (offset + len > size_) {
    co_return CorruptionError(GsUrl(bucket_, object_) + ": truncated: wanted " + std::to_string(len) +
                              " bytes at offset " + std::to_string(offset) + ", the object has " +
                              std::to_string(size_));
  }
  Lane& lane = storage_->NextLane();
  co_return co_await runtime::OnLoop(*lane.loop, lane.client->Read(bucket_, object_, offset, len, dst, size_, crc));
}

Task<Result<std::vector<Entry>>> GcsStorage::List() {
  // One listing of every object under the root (paged): the first path
  // component names the checkpoint; its manifest says it is committed.
  CO_ASSIGN_OR_RETURN(gcs::ListResult listed, co_await client_->List(bucket(), Base(), ""));
  std::map<std::string, bool> entries;
  const std::string base = Base();
  for (const gcs::ObjectMeta& o : listed.objects) {
    std::string rest = o.name.substr(base.size());
    size_t slash = rest.find('/');
    if (slash == std::string::npos) continue;  // an object directly under the root: not ours
    bool& committed = entries[rest.substr(0, slash)];
    committed = committed || rest.substr(slash + 1) == kManifest;
  }
  std::vector<Entry> out;
  for (auto& [name, committed] : entries) out.push_back({name, committed, Status::Ok()});
  co_return out;
}

Task<Result<std::unique_ptr<CheckpointWriter>>> GcsStorage::StartCheckpoint(std::string name, bool replace,
                                                                            bool shared) {
  // Objects go in place whether one process writes or many (`shared`): each
  // writer's Abort deletes only its own objects anyway.
  (void)shared;
  if (replace) {
    // Objects are overwritten in place, so the old checkpoint must go first
    // (manifest first): on GCS a replacement is not atomic, but never torn.
    CO_TRY(co_await Remove(name));
  }
  co_return std::unique_ptr<CheckpointWriter>(new GcsWriter(this, std::move(name)));
}

Task<Result<std::string>> GcsStorage::ReadSmallFile(std::string checkpoint, std::string file, uint64_t max_bytes) {
  co_return co_await client_->ReadAll(bucket(), Object(checkpoint, file), max_bytes);
}

Task<Result<std::unique_ptr<ReadableFile>>> GcsStorage::OpenFile(std::string checkpoint, std::string file) {
  const std::string object = Object(checkpoint, file);
  CO_ASSIGN_OR_RETURN(gcs::ObjectMeta meta, co_await client_->Stat(bucket(), object));
  co_return std::unique_ptr<ReadableFile>(new GcsReadable(this, bucket(), object, meta.size));
}

Task<Status> GcsStorage::Remove(std::string name) {
  const std::string dir = Base() + name + "/";
  const std::string manifest = dir + kManifest;
  // The manifest goes first: from then on the checkpoint does not exist. The
  // listing of the rest runs meanwhile (one round trip instead of two); it
  // may or may not still see the manifest, which is skipped either way.
  Task<Status> unpublish = client_->Delete(bucket(), manifest);
  Task<Result<gcs::ListResult>> listing = client_->List(bucket(), dir, "");
  auto both = WhenAll(std::move(unpublish), std::move(listing));
  auto [unpublished, listed] = co_await std::move(both);
  CO_TRY(unpublished);
  CO_TRY(listed.status());
  std::vector<Task<Status>> deletes;
  for (const gcs::ObjectMeta& o : listed->objects) {
    if (o.name != manifest) deletes.push_back(client_->Delete(bucket(), o.name));
  }
  std::vector<Status> results = co_await WhenAll(std::move(deletes));
  for (Status& s : results) CO_TRY(s);
  co_return Status::Ok();
}

Task<Status> GcsStorage::RemoveExcept(std::string name, std::vector<std::string> keep) {
  const std::string dir = Base() + name + "/";
  const std::string manifest = dir + kManifest;
  Status unpublished = co_await client_->Delete(bucket(), manifest);
  if (!unpublished.ok() && unpublished.code() != StatusCode::kNotFound) co_return unpublished;
  CO_ASSIGN_OR_RETURN(gcs::ListResult listed, co_await client_->List(bucket(), dir, ""));
  std::vector<Task<Status>> deletes;
  for (const gcs::ObjectMeta& o : listed.objects) {
    const std::string file = o.name.substr(dir.size());
    if (o.name != manifest && std::find(keep.begin(), keep.end(), file) == keep.end()) {
      deletes.push_back(client_->Delete(bucket(), o.name));
    }
  }
  std::vector<Status> results = co_await WhenAll(std::move(deletes));
  for (Status& s : results) {
    if (!s.ok() && s.code() != StatusCode::kNotFound) co_return s;
  }
  co_return Status::Ok();
}

Task<Status> GcsWriter::WriteFile(const FileImage* image) {
  gcs::UploadSource source;
  for (const Segment& s : image->segments) source.pieces.push_back({s.data, s.len});
  source.size = image->size;
  source.crc32c = image->crc32c;
  source.crc_ready = image->crc_ready;
  source.progress = image->progress;
  source.resume_session = image->resume_session;
  source.on_session = image->record_session;
  const std::string object = storage_->Object(name_, image->name);
  uploaded_.push_back(object);
  Lane& lane = storage_->NextLane();
  if (lane.thread == nullptr || image->crc_ready == nullptr) {
    auto meta = co_await runtime::OnLoop(*lane.loop, lane.client->Upload(storage_->bucket(), object, &source));
    co_return meta.status();
  }
  // On another loop, which must not touch this loop's CRC event: a twin of
  // it on that loop is set once the CRC is ready here. The pipeline always
  // sets the CRC event, failed upload or not, so the forward always ends.
  runtime::AsyncEvent lane_crc_ready;
  source.crc_ready = &lane_crc_ready;
  Task<Result<gcs::ObjectMeta>> upload =
      runtime::OnLoop(*lane.loop, lane.client->Upload(storage_->bucket(), object, &source));
  Task<void> forward = ForwardEvent(image->crc_ready, lane.loop, &lane_crc_ready);
  auto both = WhenAll(std::move(upload), std::move(forward));
  auto [meta, forwarded] = co_await std::move(both);
  (void)forwarded;
  co_return meta.status();
}

Task<Status> GcsWriter::WriteSmall(std::string name, std::string bytes) {
  const std::string object = storage_->Object(name_, name);
  uploaded_.push_back(object);
  auto meta = co_await storage_->client().UploadSmall(storage_->bucket(), object, std::move(bytes), std::nullopt);
  co_return meta.status();
}

Task<Result<std::string>> GcsWriter::ReadSmall(std::string name, uint64_t max_bytes) {
  co_return co_await storage_->client().ReadAll(storage_->bucket(), storage_->Object(name_, name), max_bytes);
}

Task<Status> GcsWriter::Commit(std::string manifest_json) {
  const std::string object = storage_->Object(name_, kManifest);
  auto meta = co_await storage_->client().UploadSmall(storage_->bucket(), object, std::move(manifest_json), 0);
  if (meta.status().code() == StatusCode::kAlreadyExists) {
    co_return AlreadyExistsError(GsUrl(storage_->bucket(), object) + " already exists");
  }
  co_return meta.status();
}

Task<Status> GcsWriter::Abort() {
  std::vector<Task<Status>> deletes;
  for (const std::string& object : uploaded_) deletes.push_back(storage_->client().Delete(storage_->bucket(), object));
  uploaded_.clear();
  std::vector<Status> results = co_await WhenAll(std::move(deletes));
  for (Status& s : results) CO_TRY(s);
  co_return Status::Ok();
}

}  // namespace

Task<Result<std::unique_ptr<Storage>>> OpenGcsStorage(runtime::Loop& loop, std::string url, Options::Gcs options) {
  CO_ASSIGN_OR_RETURN(gcs::GcsPath path, gcs::ParseGcsUrl(url));
  std::string endpoint = options.endpoint;
  bool emulator = false;
  if (endpoint.empty()) {
    const char* host = std::getenv("STORAGE_EMULATOR_HOST");
    if (host != nullptr && *host != '\0') {
      endpoint = host;
      if (endpoint.find("://") == std::string::npos) endpoint = "http://" + endpoint;
      emulator = true;
    } else {
      endpoint = "https://storage.googleapis.com";
    }
  }
  http::HttpOptions ho;
  ho.http_version = options.http_version;
  ho.connect_timeout = options.timeouts.connect;
  ho.stall_timeout = options.timeouts.stall;
  ho.ca_file = options.ca_file;
  // gcs.connections is the total: split among the lanes.
  const int loops = std::max(1, options.loops);
  ho.max_connections = std::max(1, (options.connections + loops - 1) / loops);
  // gcs.max_upload_bandwidth is the root's: one pacer for all lanes.
  std::shared_ptr<gcs::UploadPacer> pacer;
  if (options.max_upload_bandwidth > 0) pacer = std::make_shared<gcs::UploadPacer>(options.max_upload_bandwidth);
  std::vector<std::unique_ptr<Lane>> lanes;
  for (int i = 0; i < loops; ++i) {
    auto lane = std::make_unique<Lane>();
    if (i == 0) {
      lane->loop = &loop;
    } else {
      CO_ASSIGN_OR_RETURN(lane->thread, runtime::LoopThread::Start({}, "ckptio-gcs-" + std::to_string(i)));
      lane->loop = &lane->thread->loop();
    }
    Task<Status> making = MakeClients(lane.get(), ho, options, emulator, endpoint, pacer);
    CO_TRY(co_await runtime::OnLoop(*lane->loop, std::move(making)));  // on failure ~Lane cleans up
    lanes.push_back(std::move(lane));
  }
  std::string root = "gs://" + path.bucket + (path.prefix.empty() ? "" : "/" + path.prefix);
  co_return std::unique_ptr<Storage>(
      new GcsStorage(std::move(root), std::move(path), std::move(lanes)));
}

}  // namespace ckptio::storage
