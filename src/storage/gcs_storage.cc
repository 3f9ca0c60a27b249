#include "storage/gcs_storage.h"

#include <cstdlib>
#include <map>
#include <set>
#include <vector>

#include "ckptio/when_all.h"
#include "gcs/auth.h"
#include "gcs/gcs_client.h"
#include "gcs/gcs_url.h"
#include "http/http_client.h"

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

class GcsReadable final : public ReadableFile {
 public:
  GcsReadable(GcsClient* client, std::string bucket, std::string object, uint64_t size)
      : client_(client), bucket_(std::move(bucket)), object_(std::move(object)), size_(size) {}
  uint64_t size() const override { return size_; }
  Task<Status> ReadAt(uint64_t offset, char* dst, size_t len) override {
    if (offset + len > size_) {
      co_return CorruptionError(GsUrl(bucket_, object_) + ": truncated: wanted " + std::to_string(len) +
                                " bytes at offset " + std::to_string(offset) + ", the object has " +
                                std::to_string(size_));
    }
    co_return co_await client_->Read(bucket_, object_, offset, len, dst, size_);
  }

 private:
  GcsClient* client_;
  std::string bucket_;
  std::string object_;
  uint64_t size_;
};

class GcsStorage final : public Storage {
 public:
  GcsStorage(std::string root, gcs::GcsPath path, std::unique_ptr<http::HttpClient> http,
             std::unique_ptr<gcs::AuthProvider> auth, std::unique_ptr<GcsClient> client)
      : root_(std::move(root)), path_(std::move(path)), http_(std::move(http)), auth_(std::move(auth)),
        client_(std::move(client)) {}

  const std::string& root() const override { return root_; }
  Task<Result<std::vector<Entry>>> List() override;
  Task<Result<std::unique_ptr<CheckpointWriter>>> StartCheckpoint(std::string name, bool replace,
                                                                 bool shared) override;
  Task<Result<std::string>> ReadSmallFile(std::string checkpoint, std::string file, uint64_t max_bytes) override;
  Task<Result<std::unique_ptr<ReadableFile>>> OpenFile(std::string checkpoint, std::string file) override;
  Task<Status> Remove(std::string name) override;
  Status LockForWriting() override { return Status::Ok(); }
  uint64_t retries() const override { return client_->stats().retries; }
  uint64_t requests() const override { return client_->stats().requests; }

  GcsClient& client() { return *client_; }
  const std::string& bucket() const { return path_.bucket; }
  // "prefix/" or "" : what every object name of this root starts with.
  std::string Base() const { return path_.prefix.empty() ? "" : path_.prefix + "/"; }
  std::string Object(const std::string& checkpoint, const std::string& file) const {
    return Base() + checkpoint + "/" + file;
  }

 private:
  std::string root_;
  gcs::GcsPath path_;
  std::unique_ptr<http::HttpClient> http_;
  std::unique_ptr<gcs::AuthProvider> auth_;
  std::unique_ptr<GcsClient> client_;
};

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
  for (auto& [name, committed] : entries) out.push_back({name, committed});
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
  co_return std::unique_ptr<ReadableFile>(new GcsReadable(client_.get(), bucket(), object, meta.size));
}

Task<Status> GcsStorage::Remove(std::string name) {
  const std::string dir = Base() + name + "/";
  CO_ASSIGN_OR_RETURN(gcs::ListResult listed, co_await client_->List(bucket(), dir, ""));
  // The manifest first: from then on the checkpoint does not exist.
  for (const gcs::ObjectMeta& o : listed.objects) {
    if (o.name == dir + kManifest) CO_TRY(co_await client_->Delete(bucket(), o.name));
  }
  std::vector<Task<Status>> deletes;
  for (const gcs::ObjectMeta& o : listed.objects) {
    if (o.name != dir + kManifest) deletes.push_back(client_->Delete(bucket(), o.name));
  }
  std::vector<Status> results = co_await WhenAll(std::move(deletes));
  for (Status& s : results) CO_TRY(s);
  co_return Status::Ok();
}

Task<Status> GcsWriter::WriteFile(const FileImage* image) {
  gcs::UploadSource source;
  for (const Segment& s : image->segments) source.pieces.push_back({s.data, s.len});
  source.size = image->size;
  source.crc32c = image->crc32c;
  source.crc_ready = image->crc_ready;
  source.progress = image->progress;
  const std::string object = storage_->Object(name_, image->name);
  uploaded_.push_back(object);
  auto meta = co_await storage_->client().Upload(storage_->bucket(), object, &source);
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
  ho.max_connections = options.connections;
  ho.http_version = options.http_version;
  ho.connect_timeout = options.timeouts.connect;
  ho.stall_timeout = options.timeouts.stall;
  ho.ca_file = options.ca_file;
  CO_ASSIGN_OR_RETURN(std::unique_ptr<http::HttpClient> http, http::HttpClient::Create(loop, ho));
  CO_ASSIGN_OR_RETURN(std::unique_ptr<gcs::AuthProvider> auth, gcs::MakeAuth(loop, *http, options, emulator));
  auto client = std::make_unique<GcsClient>(loop, *http, *auth, endpoint, options);
  std::string root = "gs://" + path.bucket + (path.prefix.empty() ? "" : "/" + path.prefix);
  co_return std::unique_ptr<Storage>(
      new GcsStorage(std::move(root), std::move(path), std::move(http), std::move(auth), std::move(client)));
}

}  // namespace ckptio::storage
