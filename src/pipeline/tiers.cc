// Two tiers (Options::tiers): the local tier commits as today; a thread of
// its own copies committed steps to the remote tier, one at a time, straight
// from the local files.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/status_macros.h"
#include "base/unique_fd.h"
#include "pipeline/manager_impl.h"
#include "pipeline/replication_journal.h"
#include "runtime/when_all.h"

namespace ckptio::pipeline {
namespace {

// A local file mapped read-only: the upload reads it through the page cache,
// so nothing is copied into this process's memory.
class MappedFile {
 public:
  static Result<MappedFile> Open(const std::string& path, uint64_t expected) {
    base::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd.valid()) return ErrnoToStatus(errno, "open", path);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, "stat", path);
    if (!S_ISREG(st.st_mode)) return CorruptionError(path + ": not a regular file");
    if (static_cast<uint64_t>(st.st_size) != expected) {
      return CorruptionError(path + ": " + std::to_string(st.st_size) + " bytes, but the manifest says " +
                             std::to_string(expected));
    }
    MappedFile m;
    m.size_ = expected;
    if (expected > 0) {
      void* p = ::mmap(nullptr, expected, PROT_READ, MAP_SHARED, fd.get(), 0);
      if (p == MAP_FAILED) return ErrnoToStatus(errno, "mmap", path);
      // Shards were written O_DIRECT (not in the page cache): start reading
      // the whole file ahead now, while the first bytes go out.
      ::madvise(p, expected, MADV_SEQUENTIAL);
      ::madvise(p, expected, MADV_WILLNEED);
      m.data_ = static_cast<char*>(p);
    }
    return m;
  }
  MappedFile() = default;
  MappedFile(MappedFile&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(o.size_) {}
  MappedFile& operator=(MappedFile&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  const char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  uint64_t size_ = 0;
};

}  // namespace

Status ManagerImpl::OpenRemoteTier(bool read_only) {
  if (options_.tiers.remote.empty()) return Status::Ok();
  if (url_.kind != storage::RootUrl::Kind::kLocal) {
    return InvalidArgumentError("tiers.remote is set, but the root " + root_ +
                                " is not a local directory: the root is the local tier");
  }
  if (multihost()) return InvalidArgumentError("tiers are not supported in multi-host saves yet");
  auto parsed = storage::ParseRootUrl(options_.tiers.remote);
  if (!parsed.ok()) return parsed.status().WithContext("tiers.remote");
  const storage::RootUrl& remote_url = *parsed;
  if (remote_url.kind == url_.kind && remote_url.path == url_.path) {
    return InvalidArgumentError("tiers.remote is the root itself (" + root_ + "): name another directory or gs:// URL");
  }
  Options remote = options_;
  remote.tiers = {};
  remote.keep = options_.tiers.remote_keep;
  remote.keep_every = options_.tiers.remote_keep_every;
  remote.staging_memory = 4096;  // the remote tier copies files, never snapshots
  remote.preemption.on_sigterm = false;
  remote.trace.path.clear();
  auto opened = Open(options_.tiers.remote, std::move(remote), read_only, nullptr);
  if (!opened.ok()) return opened.status().WithContext("cannot open the remote tier");
  remote_ = std::move(opened).value();
  if (read_only) return Status::Ok();
  // Catch up: local steps newer than the remote tier's newest (a restart
  // after a crash or a shutdown with copies pending).
  const std::optional<int64_t> newest_remote = remote_->LatestStep();
  for (int64_t step : AllSteps()) {
    if (step % options_.tiers.remote_every == 0 && (!newest_remote || step > *newest_remote)) EnqueueReplication(step);
  }
  replicator_ = std::thread([this] { ReplicatorMain(); });
  return Status::Ok();
}

void ManagerImpl::EnqueueReplication(int64_t step) {
  std::optional<int64_t> dropped;
  {
    std::lock_guard lock(mu_);
    readers_.insert(step);  // not pruned here before it is copied
    replication_queue_.push_back(step);
    // More waiting than the remote tier would keep: the oldest is dropped
    // (the copies never catch up with the saves; counted, not silent).
    const size_t bound = static_cast<size_t>(std::max(options_.tiers.remote_keep, 1)) + 1;
    if (replication_queue_.size() > bound) {
      dropped = replication_queue_.front();
      replication_queue_.pop_front();
      ++stats_.replications_skipped;
    }
  }
  if (dropped) Unpin(*dropped);
  replication_cv_.notify_all();
}

void ManagerImpl::ReplicatorMain() {
  for (;;) {
    int64_t step;
    {
      std::unique_lock lock(mu_);
      replication_cv_.wait(lock, [this] { return stop_replicating_ || !replication_queue_.empty(); });
      if (stop_replicating_) return;
      step = replication_queue_.front();
      replication_queue_.pop_front();
      replicating_ = step;
    }
    // The manifest as committed here, read through this tier's storage.
    Result<std::string> manifest = loop().BlockOn(ReadManifestBytes(step));
    Status s = manifest.ok() ? remote_->Replicate(root_, step, std::move(manifest).value()) : manifest.status();
    Unpin(step);
    // The prunes since this step committed spared it: retention applies now.
    Status pruned = loop().BlockOn(PruneNow());
    if (!pruned.ok()) {
      std::lock_guard lock(mu_);
      pending_errors_.push_back(std::move(pruned));
    }
    {
      std::lock_guard lock(mu_);
      replicating_.reset();
      if (s.ok()) {
        ++stats_.steps_replicated;
      } else {
        ++stats_.replications_failed;
        replication_errors_.push_back(std::move(s).WithContext("cannot copy step " + std::to_string(step) +
                                                               " to the remote tier " + remote_->root()));
      }
    }
    replication_cv_.notify_all();
  }
}

void ManagerImpl::StopReplicator() {
  if (!replicator_.joinable()) return;
  std::deque<int64_t> dropped;
  {
    std::lock_guard lock(mu_);
    stop_replicating_ = true;  // the copy under way finishes; queued ones wait for the next Open
    dropped.swap(replication_queue_);
  }
  replication_cv_.notify_all();
  replicator_.join();
  for (int64_t step : dropped) Unpin(step);
}

Status ManagerImpl::WaitUntilReplicated() {
  if (!remote_) return Status::Ok();
  std::unique_lock lock(mu_);
  replication_cv_.wait(lock, [this] { return replication_queue_.empty() && !replicating_; });
  return JoinFailures(std::exchange(replication_errors_, {}), "copies to the remote tier");
}

std::vector<int64_t> ManagerImpl::AllStepsAllTiers() const {
  std::vector<int64_t> all = AllSteps();
  if (remote_) {
    std::vector<int64_t> remote = remote_->AllSteps();
    all.insert(all.end(), remote.begin(), remote.end());
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
  }
  return all;
}

Status ManagerImpl::Replicate(const std::string& source, int64_t step, std::string manifest) {
  return loop().BlockOn(ReplicateTask(source, step, std::move(manifest)));
}

Task<Status> ManagerImpl::ReplicateTask(std::string source, int64_t step, std::string manifest_bytes) {
  const std::string name = StepName(step);
  const std::string dir = source + "/" + name;
  CO_ASSIGN_OR_RETURN(format::Manifest m, format::ParseManifest(dir + "/manifest.json", manifest_bytes));
  // What to send: this step's files, and the files of earlier steps it uses
  // that this tier lacks (sent as files of this step, under a name of their
  // own). A file of an earlier step this tier has stays referenced.
  std::vector<MappedFile> maps;
  std::vector<storage::FileImage> images;
  std::vector<uint32_t> crcs;  // each image's, from the manifest
  bool renamed = false;
  for (format::ManifestShard& s : m.shards) {
    std::string path = dir + "/" + s.name;
    if (!s.checkpoint.empty()) {
      auto there = co_await storage_->OpenFile(s.checkpoint, s.name);
      if (there.ok() && (*there)->size() == s.bytes) continue;
      path = source + "/" + s.checkpoint + "/" + s.name;
      s.name = s.checkpoint + "." + s.name;
      s.checkpoint.clear();
      renamed = true;
    }
    auto map = MappedFile::Open(path, s.bytes);
    if (!map.ok()) co_return std::move(map).status();
    maps.push_back(std::move(map).value());
    storage::FileImage image;
    image.name = s.name;
    image.size = s.bytes;
    if (s.bytes > 0) image.segments.push_back({0, maps.back().data(), s.bytes, s.bytes});
    images.push_back(std::move(image));
    crcs.push_back(s.crc32c);
  }
  // The CRCs are known before any write. The upload sessions are recorded
  // in the local tier: a copy a killed process left unfinished goes on
  // where the server's sessions stand.
  runtime::AsyncEvent crc_ready;
  crc_ready.Set();
  ReplicationJournal journal = ReplicationJournal::Load(source, root_, step);
  for (size_t i = 0; i < images.size(); ++i) {
    images[i].crc32c = &crcs[i];
    images[i].crc_ready = &crc_ready;
    images[i].resume_session = journal.Session(images[i].name);
    images[i].record_session = [&journal, file = images[i].name](const std::string& session) {
      return journal.Record(file, session);
    };
  }
  if (renamed) {
    m.format_version = format::FormatVersionFor(m);
    CO_TRY(format::ValidateManifest(name + "/manifest.json (remote copy)", m));
    manifest_bytes = format::SerializeManifest(m);
  }
  CO_ASSIGN_OR_RETURN(std::unique_ptr<storage::CheckpointWriter> writer,
                      co_await storage_->StartCheckpoint(name, /*replace=*/false));
  std::vector<Task<Status>> writes;
  for (const storage::FileImage& image : images) writes.push_back(writer->WriteFile(&image));
  std::vector<Status> written = co_await WhenAll(std::move(writes));
  Status s;
  for (Status& w : written) {
    if (s.ok() && !w.ok()) s = std::move(w);
  }
  if (s.ok()) s = co_await writer->Commit(std::move(manifest_bytes));
  if (!s.ok()) {
    Status aborted = co_await writer->Abort();
    aborted.IgnoreError();
    Status forgotten = journal.Clear();  // what the sessions hold is deleted: start afresh
    forgotten.IgnoreError();
    co_return s;
  }
  // A journal left behind is harmless (it names a step already copied).
  Status forgotten = journal.Clear();
  forgotten.IgnoreError();
  {
    std::lock_guard lock(mu_);
    committed_.insert(step);
    ++stats_.saves_committed;
    for (const storage::FileImage& image : images) stats_.bytes_committed += image.size;
  }
  References refs;
  AddReferences(m, &refs);
  refs_[step] = std::move(refs);
  co_return co_await PruneNow();
}

}  // namespace ckptio::pipeline
