// Reads on a host of its own (two tiers in a multi-host job): a step of the
// local tier holds this host's files and its local copies (host_part.h); a
// read takes every tensor it needs from there, and only the others (another
// process's files: a replaced host, another process count or mesh) from the
// remote tier, with ranged reads.

#include <optional>
#include <unordered_map>

#include "base/status_macros.h"
#include "format/manifest.h"
#include "pipeline/host_part.h"
#include "pipeline/manager_impl.h"
#include "runtime/loop.h"

namespace ckptio::pipeline {
namespace {

// A file of another loop's storage, read from this loop: each read hops to
// the storage's loop and back (runtime::OnLoop), and counts its bytes.
class OnLoopFile final : public storage::ReadableFile {
 public:
  OnLoopFile(std::unique_ptr<storage::ReadableFile> inner, runtime::Loop* loop, std::atomic<uint64_t>* bytes)
      : inner_(std::move(inner)), loop_(loop), bytes_(bytes) {}
  uint64_t size() const override { return inner_->size(); }
  Task<Status> ReadAt(uint64_t offset, char* dst, size_t len) override {
    Task<Status> read = inner_->ReadAt(offset, dst, len);
    Status s = co_await runtime::OnLoop(*loop_, std::move(read));
    if (s.ok()) bytes_->fetch_add(len, std::memory_order_relaxed);
    co_return s;
  }
  bool ChecksumsWhileReading() const override { return inner_->ChecksumsWhileReading(); }
  Task<Status> ReadAtCrc(uint64_t offset, char* dst, size_t len, uint32_t* crc) override {
    Task<Status> read = inner_->ReadAtCrc(offset, dst, len, crc);
    Status s = co_await runtime::OnLoop(*loop_, std::move(read));
    if (s.ok()) bytes_->fetch_add(len, std::memory_order_relaxed);
    co_return s;
  }
  // `iov` is the caller's, alive until this task ends.
  Task<Status> ReadAtV(uint64_t offset, std::span<struct iovec> iov, char* scratch) override {
    size_t len = 0;
    for (const struct iovec& v : iov) len += v.iov_len;
    Task<Status> read = inner_->ReadAtV(offset, iov, scratch);
    Status s = co_await runtime::OnLoop(*loop_, std::move(read));
    if (s.ok()) bytes_->fetch_add(len, std::memory_order_relaxed);
    co_return s;
  }

 private:
  std::unique_ptr<storage::ReadableFile> inner_;
  runtime::Loop* loop_;
  std::atomic<uint64_t>* bytes_;
};

// The remote tier's storage as seen from the local tier's loop: reads only.
class RemoteFiles final : public storage::Storage {
 public:
  RemoteFiles(storage::Storage* inner, runtime::Loop* loop, std::atomic<uint64_t>* bytes)
      : inner_(inner), loop_(loop), bytes_(bytes) {}
  const std::string& root() const override { return inner_->root(); }
  Task<Result<std::string>> ReadSmallFile(std::string checkpoint, std::string file, uint64_t max_bytes) override {
    Task<Result<std::string>> read = inner_->ReadSmallFile(std::move(checkpoint), std::move(file), max_bytes);
    co_return co_await runtime::OnLoop(*loop_, std::move(read));
  }
  Task<Result<std::unique_ptr<storage::ReadableFile>>> OpenFile(std::string checkpoint, std::string file) override {
    Task<Result<std::unique_ptr<storage::ReadableFile>>> open = inner_->OpenFile(std::move(checkpoint), std::move(file));
    auto opened = co_await runtime::OnLoop(*loop_, std::move(open));
    if (!opened.ok()) co_return std::move(opened).status();
    co_return std::unique_ptr<storage::ReadableFile>(new OnLoopFile(std::move(opened).value(), loop_, bytes_));
  }
  // Nothing else: this view only reads.
  Task<Result<std::vector<storage::Entry>>> List() override { co_return Refused("list"); }
  Task<Result<std::unique_ptr<storage::CheckpointWriter>>> StartCheckpoint(std::string, bool, bool) override {
    co_return Refused("write");
  }
  Task<Status> Remove(std::string) override { co_return Refused("remove"); }
  Task<Status> RemoveExcept(std::string, std::vector<std::string>) override { co_return Refused("remove"); }
  Status LockForWriting() override { return Refused("lock"); }

 private:
  Status Refused(const char* what) const {
    return InternalError(std::string("the remote tier's read-only view cannot ") + what + " " + inner_->root());
  }
  storage::Storage* inner_;
  runtime::Loop* loop_;
  std::atomic<uint64_t>* bytes_;
};

// Whether two manifests of a step describe the same tensors (the files may
// be named otherwise: the remote tier's copy renames files of earlier steps
// it lacked).
bool SameTensors(const format::Manifest& a, const format::Manifest& b) {
  if (a.step != b.step || a.tensors.size() != b.tensors.size()) return false;
  std::unordered_map<std::string_view, const format::ManifestTensor*> by_name;
  for (const format::ManifestTensor& t : b.tensors) by_name.emplace(t.name, &t);
  for (const format::ManifestTensor& t : a.tensors) {
    auto it = by_name.find(t.name);
    if (it == by_name.end()) return false;
    const format::ManifestTensor& u = *it->second;
    if (u.crc32c != t.crc32c || u.bytes != t.bytes || u.dtype != t.dtype || u.shape != t.shape) return false;
  }
  return true;
}

}  // namespace

std::unique_ptr<storage::Storage> MakeRemoteFiles(storage::Storage* remote, runtime::Loop* loop,
                                                  std::atomic<uint64_t>* bytes) {
  return std::make_unique<RemoteFiles>(remote, loop, bytes);
}

std::vector<int64_t> ManagerImpl::AgreedSteps() const {
  std::lock_guard lock(mu_);
  std::vector<int64_t> out;
  for (int64_t step : committed_) {
    if (agreed_.count(step) != 0) out.push_back(step);
  }
  return out;
}

Task<Result<OpenedCheckpoint>> ManagerImpl::OpenStep(int64_t step, TensorFilter filter, bool held_only) {
  const std::string name = StepName(step);
  // The manifest alone first: what a per-host step holds here decides where
  // each shard is opened from.
  auto none = [](const format::Manifest&) { return std::vector<bool>(); };
  CO_ASSIGN_OR_RETURN(OpenedCheckpoint c, co_await OpenCheckpoint(storage_.get(), name, none));
  c.bytes_read = &bytes_read_;
  CO_TRY(ManifestIsStep(c.path + "/manifest.json", c.manifest, step));
  // Only a local tier holds hosts' parts (a remote store is never asked).
  Result<std::string> part_bytes = NotFoundError(kLocalPartFile);
  if (url_.kind == storage::RootUrl::Kind::kLocal) {
    part_bytes = co_await storage_->ReadSmallFile(name, kLocalPartFile, format::kMaxManifestBytes);
    if (!part_bytes.ok() && part_bytes.status().code() != StatusCode::kNotFound) co_return part_bytes.status();
  }
  std::vector<bool> wanted_tensor(c.manifest.tensors.size(), true);
  if (filter) {
    for (size_t i = 0; i < wanted_tensor.size(); ++i) wanted_tensor[i] = filter(c.manifest.tensors[i]);
  }
  std::vector<storage::Storage*> sources(c.manifest.shards.size(), nullptr);
  if (!part_bytes.ok()) {  // a whole checkpoint: every file is here
    for (size_t i = 0; i < wanted_tensor.size(); ++i) {
      if (wanted_tensor[i]) sources[c.manifest.tensors[i].shard] = storage_.get();
    }
    CO_TRY(co_await OpenShards(&c, std::move(sources), /*subset=*/false));
    co_return std::move(c);
  }
  // A host's part: its own files, and its local copies of other processes'
  // tensors, which stand in for those tensors' files.
  CO_ASSIGN_OR_RETURN(format::Manifest part,
                      format::ParseManifest(c.path + "/" + kLocalPartFile, *part_bytes, format::Chunks::kPartial));
  const int owner = part.metadata.value("process_index", -1);
  if (held_only) {
    c.manifest = HeldPart(c.manifest, &part, owner);
    sources.assign(c.manifest.shards.size(), storage_.get());
    CO_TRY(co_await OpenShards(&c, std::move(sources), /*subset=*/false));
    co_return std::move(c);
  }
  // A verified copy of the step: where the remote tier has the step too, its
  // manifest says what this one does (else this host's files belong to
  // another save of the step, and the whole step is read there).
  std::optional<format::Manifest> remote_manifest;
  const std::vector<int64_t> remote_steps = remote_ ? remote_->AllSteps() : std::vector<int64_t>();
  if (remote_files_ != nullptr && std::binary_search(remote_steps.begin(), remote_steps.end(), step)) {
    CO_ASSIGN_OR_RETURN(std::string bytes,
                        co_await remote_files_->ReadSmallFile(name, "manifest.json", format::kMaxManifestBytes));
    const std::string remote_path = remote_->root() + "/" + name;
    CO_ASSIGN_OR_RETURN(remote_manifest, format::ParseManifest(remote_path + "/manifest.json", bytes));
    if (!SameTensors(c.manifest, *remote_manifest)) {
      co_return CorruptionError(c.path + "/manifest.json: differs from " + remote_path +
                                "/manifest.json (another save of step " + std::to_string(step) + ")");
    }
  }
  std::vector<bool> local_shard(c.manifest.shards.size());
  for (size_t i = 0; i < local_shard.size(); ++i) local_shard[i] = FileOwner(c.manifest.shards[i].name) == owner;
  std::unordered_map<std::string_view, const format::ManifestTensor*> copies;
  for (const format::ManifestTensor& t : part.tensors) copies.emplace(t.name, &t);
  const auto copy_base = static_cast<uint32_t>(c.manifest.shards.size());
  c.manifest.shards.insert(c.manifest.shards.end(), part.shards.begin(), part.shards.end());
  local_shard.resize(c.manifest.shards.size(), true);
  std::vector<size_t> elsewhere;  // wanted, and neither in this host's files nor copied here
  for (size_t i = 0; i < c.manifest.tensors.size(); ++i) {
    format::ManifestTensor& t = c.manifest.tensors[i];
    if (!wanted_tensor[i] || local_shard[t.shard]) continue;
    auto it = copies.find(t.name);
    if (it != copies.end() && it->second->crc32c == t.crc32c && it->second->bytes == t.bytes) {
      t = *it->second;
      t.shard += copy_base;
    } else {
      elsewhere.push_back(i);
    }
  }
  if (!elsewhere.empty()) {
    CO_TRY(TakeFromRemote(step, remote_manifest ? &*remote_manifest : nullptr, &c, &local_shard, elsewhere));
  }
  sources.assign(c.manifest.shards.size(), nullptr);
  for (size_t i = 0; i < c.manifest.tensors.size(); ++i) {
    const uint32_t shard = c.manifest.tensors[i].shard;
    if (wanted_tensor[i]) sources[shard] = local_shard[shard] ? storage_.get() : remote_files_.get();
  }
  CO_TRY(co_await OpenShards(&c, std::move(sources), /*subset=*/true));
  co_return std::move(c);
}

Status ManagerImpl::TakeFromRemote(int64_t step, const format::Manifest* remote, OpenedCheckpoint* c,
                                   std::vector<bool>* local_shard, const std::vector<size_t>& wanted) {
  const std::string& tensor = c->manifest.tensors[wanted.front()].name;
  if (remote == nullptr) {
    return NotFoundError(c->path + ": tensor \"" + tensor + "\" (and " + std::to_string(wanted.size() - 1) +
                         " more) is held by another host's local tier" +
                         (remote_ ? ", and the remote tier " + remote_->root() + " has no step " +
                                        std::to_string(step)
                                  : " (this is one host's part of a multi-host step: read it with the "
                                    "remote tier set, tiers.remote, or from the remote tier itself)"));
  }
  const format::Manifest& r = *remote;
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t i = 0; i < r.tensors.size(); ++i) by_name.emplace(r.tensors[i].name, i);
  std::unordered_map<uint32_t, uint32_t> shard_of;  // r's shard -> c's
  uint64_t bytes_there = 0;
  for (size_t i : wanted) {
    format::ManifestTensor& t = c->manifest.tensors[i];
    const format::ManifestTensor& there = r.tensors[by_name.at(t.name)];
    auto [it, added] = shard_of.emplace(there.shard, static_cast<uint32_t>(c->manifest.shards.size()));
    if (added) {
      c->manifest.shards.push_back(r.shards[there.shard]);
      local_shard->push_back(false);
    }
    t = there;
    t.shard = it->second;
    bytes_there += t.bytes;
  }
  if (!warned_remote_reads_.exchange(true)) {
    std::fprintf(stderr,
                 "ckptio: step %lld: %zu tensors this process reads (%s, \"%s\" among them) are not in its local "
                 "tier %s; reading them from the remote tier %s (said once)\n",
                 static_cast<long long>(step), wanted.size(), FormatBytes(bytes_there).c_str(), tensor.c_str(),
                 root_.c_str(), remote_->root().c_str());
  }
  return Status::Ok();
}

}  // namespace ckptio::pipeline
