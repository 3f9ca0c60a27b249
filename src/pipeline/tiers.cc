// Two tiers (Options::tiers): the local tier commits as today; a thread of
// its own copies committed steps to the remote tier, one at a time, straight
// from the local files.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/status_macros.h"
#include "base/unique_fd.h"
#include "format/crc32c.h"
#include "pipeline/fragments.h"
#include "pipeline/host_part.h"
#include "pipeline/manager_impl.h"
#include "pipeline/replication_journal.h"
#include "runtime/io_ops.h"
#include "runtime/when_all.h"

namespace ckptio::pipeline {
namespace {

// Memory this file maps: a local file read-only (the upload reads it through
// the page cache, so nothing is copied into this process's memory), or
// anonymous memory to copy files through.
class Mapping {
 public:
  static Result<Mapping> OfFile(const std::string& path, uint64_t expected) {
    base::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!fd.valid()) return ErrnoToStatus(errno, "open", path);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, "stat", path);
    if (!S_ISREG(st.st_mode)) return CorruptionError(path + ": not a regular file");
    if (static_cast<uint64_t>(st.st_size) != expected) {
      return CorruptionError(path + ": " + std::to_string(st.st_size) + " bytes, but the manifest says " +
                             std::to_string(expected));
    }
    Mapping m;
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
  // Allocated for one copy (a one-off, not per save) and unmapped after it.
  static Result<Mapping> Anonymous(uint64_t bytes) {
    Mapping m;
    if (bytes == 0) return m;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return ErrnoToStatus(errno, "allocate " + std::to_string(bytes) + " bytes to copy files");
    m.data_ = static_cast<char*>(p);
    m.size_ = bytes;
    return m;
  }
  Mapping() = default;
  Mapping(Mapping&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(o.size_) {}
  Mapping& operator=(Mapping&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
    return *this;
  }
  ~Mapping() {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  char* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  char* data_ = nullptr;
  uint64_t size_ = 0;
};

// A file of an earlier step that the destination tier lacks is copied as a
// file of the step itself, named after its owner
// ("checkpoint_1.shard-00000.safetensors").
void AdoptAsOwnFile(format::ManifestShard* s) {
  s->name = s->checkpoint + "." + s->name;
  s->checkpoint.clear();
}

// The bytes of a manifest whose files were adopted, checked again.
Result<std::string> Reserialize(format::Manifest* m, const std::string& what) {
  m->format_version = format::FormatVersionFor(*m);
  RETURN_IF_ERROR(format::ValidateManifest(what, *m));
  return format::SerializeManifest(*m);
}

}  // namespace

Status ManagerImpl::OpenRemoteTier(bool read_only) {
  if (options_.tiers.remote.empty()) return Status::Ok();
  if (url_.kind != storage::RootUrl::Kind::kLocal) {
    return InvalidArgumentError("tiers.remote is set, but the root " + root_ +
                                " is not a local directory: the root is the local tier");
  }
  auto parsed = storage::ParseRootUrl(options_.tiers.remote);
  if (!parsed.ok()) return parsed.status().WithContext("tiers.remote");
  storage::RootUrl remote_url = std::move(parsed).value();
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
  // A multi-host job's processes commit the remote tier's steps without
  // their barrier: each copies at its own pace and leaves its fragment there
  // once its files are sent; process 0 polls for the others' (multihost.cc).
  remote.multihost.barrier = "storage";
  auto opened = Open(std::move(remote_url), std::move(remote), read_only, nullptr);
  if (!opened.ok()) return opened.status().WithContext("cannot open the remote tier");
  remote_ = std::move(opened).value();
  remote_files_ = MakeRemoteFiles(remote_->storage_.get(), &remote_->loop(), &bytes_read_remote_);
  return Status::Ok();
}

void ManagerImpl::StartReplicator() {
  if (!remote_) return;
  // Catch up: local steps newer than the remote tier's newest (a restart
  // after a crash or a shutdown with copies pending). On hosts of their own,
  // the steps every host holds: the others can never be completed there.
  const std::optional<int64_t> newest_remote = remote_->LatestStep();
  for (int64_t step : per_host() ? AgreedSteps() : AllSteps()) {
    if (step % options_.tiers.remote_every == 0 && (!newest_remote || step > *newest_remote)) EnqueueReplication(step);
  }
  // A new machine: the remote tier's newest step is copied here too.
  if (options_.tiers.seed_local && newest_remote) {
    const std::optional<int64_t> newest_local = LatestStep();
    if (!newest_local || *newest_remote > *newest_local) seed_step_ = *newest_remote;
  }
  replicator_ = std::thread([this] { ReplicatorMain(); });
}

void ManagerImpl::EnqueueReplication(int64_t step) {
  std::optional<int64_t> dropped;
  {
    std::lock_guard lock(mu_);
    readers_.insert(step);  // not pruned here before it is copied
    replication_queue_.push_back(step);
    // More waiting than the remote tier would keep: the oldest is dropped
    // (the copies never catch up with the saves; counted, not silent). A
    // remote tier that keeps every step (remote_keep 0) gets every step, and
    // a step it keeps forever (remote_keep_every) is never dropped.
    // On hosts of their own, process 0 decided before the step was queued
    // (PlanReplicationSkips), for every host alike.
    if (!per_host()) dropped = DropOldestQueued(replication_queue_.size());
  }
  if (dropped) SkipReplication(*dropped);
  replication_cv_.notify_all();
}

std::optional<int64_t> ManagerImpl::DropOldestQueued(size_t queued) {
  const size_t bound = static_cast<size_t>(options_.tiers.remote_keep) + 1;
  const int64_t forever = options_.tiers.remote_keep_every;
  if (options_.tiers.remote_keep <= 0 || queued <= bound) return std::nullopt;
  auto oldest = std::find_if(replication_queue_.begin(), replication_queue_.end(),
                             [forever](int64_t s) { return forever <= 0 || s % forever != 0; });
  if (oldest == replication_queue_.end()) return std::nullopt;
  const int64_t step = *oldest;
  replication_queue_.erase(oldest);
  ++stats_.replications_skipped;
  return step;
}

void ManagerImpl::SkipReplication(int64_t step) {
  Unpin(step);
  if (!warned_replication_skipped_.exchange(true)) {
    std::fprintf(stderr,
                 "ckptio: warning: step %lld is not copied to the remote tier %s: newer steps wait (the copies "
                 "are slower than the saves; stats()[\"replications_skipped\"] counts every such step, this "
                 "warning is printed once)\n",
                 static_cast<long long>(step), remote_->root().c_str());
  }
}

nlohmann::json ManagerImpl::PlanReplicationSkips(int64_t step) {
  nlohmann::json out = nlohmann::json::array();
  if (!remote_ || step % options_.tiers.remote_every != 0) return out;
  std::optional<int64_t> dropped;
  {
    std::lock_guard lock(mu_);
    // Off this queue at once: the copy cannot start it meanwhile.
    dropped = DropOldestQueued(replication_queue_.size() + 1);
  }
  if (dropped) {
    SkipReplication(*dropped);
    out.push_back(*dropped);
  }
  return out;
}

void ManagerImpl::ApplyReplicationSkips(const std::vector<int64_t>& steps) {
  if (!remote_ || leader()) return;  // process 0 took them off its queue when it decided
  std::vector<int64_t> dropped;
  {
    std::lock_guard lock(mu_);
    for (int64_t step : steps) {
      // Counted as on process 0, whether this host had sent its part yet or not.
      ++stats_.replications_skipped;
      skipped_remote_.insert(step);
      awaiting_remote_commit_.erase(step);
      auto it = std::find(replication_queue_.begin(), replication_queue_.end(), step);
      if (it == replication_queue_.end()) continue;
      replication_queue_.erase(it);
      dropped.push_back(step);
    }
  }
  for (int64_t step : dropped) SkipReplication(step);
}

void ManagerImpl::ReplicatorMain() {
  for (;;) {
    int64_t step;
    bool seed = false;
    {
      std::unique_lock lock(mu_);
      replication_cv_.wait(lock, [this] { return stop_replicating_ || seed_step_ || !replication_queue_.empty(); });
      if (stop_replicating_) return;
      if (seed_step_) {
        step = *std::exchange(seed_step_, std::nullopt);
        seed = true;
      } else {
        step = replication_queue_.front();
        replication_queue_.pop_front();
      }
      replicating_ = step;
    }
    if (seed) {
      Status s = SeedFromRemote(step);
      {
        std::lock_guard lock(mu_);
        replicating_.reset();
        if (s.ok()) {
          ++stats_.steps_seeded;
        } else {
          replication_errors_.push_back(std::move(s).WithContext(
              "cannot copy step " + std::to_string(step) + " of the remote tier " + remote_->root() + " here"));
        }
      }
      replication_cv_.notify_all();
      continue;
    }
    // The manifest as committed here, read through this tier's storage (a
    // failure to read it is still reported to the other hosts).
    Result<std::string> manifest = loop().BlockOn(ReadManifestBytes(step));
    std::set<int64_t> sent;
    {
      std::lock_guard lock(mu_);
      sent = awaiting_remote_commit_;
    }
    Status s = remote_->Replicate(root_, step, std::move(manifest), std::move(sent));
    Unpin(step);
    if (s.ok() && per_host() && !leader()) {
      // Process 0 commits it once every host's part is there: waited for
      // by WaitUntilReplicated, not here (the next copy starts meanwhile).
      std::lock_guard lock(mu_);
      if (skipped_remote_.count(step) == 0) awaiting_remote_commit_.insert(step);
      skipped_remote_.erase(skipped_remote_.begin(), skipped_remote_.upper_bound(step));
    }
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
    seed_step_.reset();
  }
  replication_cv_.notify_all();
  replicator_.join();
  for (int64_t step : dropped) Unpin(step);
}

Status ManagerImpl::WaitUntilReplicated() {
  if (!remote_) return Status::Ok();
  std::vector<Status> errors;
  std::set<int64_t> awaiting;
  {
    std::unique_lock lock(mu_);
    replication_cv_.wait(lock, [this] { return replication_queue_.empty() && !replicating_ && !seed_step_; });
    errors = std::exchange(replication_errors_, {});
    awaiting = awaiting_remote_commit_;
  }
  // Another host's copies: this host's parts are sent; each counts once
  // process 0 has committed its step there.
  for (int64_t step : awaiting) {
    Status committed = remote_->loop().BlockOn(remote_->AwaitCopyCommitted(step));
    if (committed.ok()) {
      std::lock_guard lock(mu_);
      awaiting_remote_commit_.erase(step);
    } else {
      errors.push_back(std::move(committed).WithContext("step " + std::to_string(step) + " in the remote tier " +
                                                        remote_->root() + " (this host's part is there)"));
    }
  }
  if (!awaiting.empty()) {
    Status listed = remote_->RefreshNow();
    listed.IgnoreError();  // the copies are what this reports on
  }
  return JoinFailures(std::move(errors), "copies to the remote tier");
}

std::vector<int64_t> ManagerImpl::AllStepsAllTiers() const {
  std::vector<int64_t> all = per_host() ? AgreedSteps() : AllSteps();
  if (remote_) {
    std::vector<int64_t> remote = remote_->AllSteps();
    all.insert(all.end(), remote.begin(), remote.end());
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
  }
  return all;
}

Status ManagerImpl::Replicate(const std::string& source, int64_t step, Result<std::string> manifest,
                              std::set<int64_t> sent) {
  return loop().BlockOn(ReplicateTask(source, step, std::move(manifest), std::move(sent)));
}

Task<Status> ManagerImpl::ReplicateTask(std::string source, int64_t step, Result<std::string> read,
                                        std::set<int64_t> sent) {
  const std::string name = StepName(step);
  const std::string dir = source + "/" + name;
  Result<format::Manifest> parsed =
      read.ok() ? format::ParseManifest(dir + "/manifest.json", *read) : Result<format::Manifest>(read.status());
  if (!parsed.ok()) {
    // A host that cannot copy its part says so where process 0 looks.
    if (multihost()) {
      Task<Status> told = ReportFailedPart(step, parsed.status());
      Status reported = co_await std::move(told);
      reported.IgnoreError();
    }
    co_return parsed.status();
  }
  format::Manifest whole = std::move(parsed).value();
  // A process of a multi-host job sends its own files (its own part).
  const int index = options_.multihost.process_index;
  format::Manifest m = !multihost() ? whole : FilterShards(whole, [index](const format::ManifestShard& f) {
    return FileOwner(f.name) == index;
  });
  std::string manifest_bytes = multihost() ? std::string() : std::move(read).value();
  // What to send: this step's files, and the files of earlier steps it uses
  // that this tier lacks (sent as files of this step, under a name of their
  // own). A file of an earlier step this tier has stays referenced.
  std::vector<Mapping> maps;
  std::vector<storage::FileImage> images;
  std::vector<uint32_t> crcs;  // each image's, from the manifest
  bool renamed = false;
  for (format::ManifestShard& s : m.shards) {
    std::string path = dir + "/" + s.name;
    if (!s.checkpoint.empty()) {
      auto there = co_await storage_->OpenFile(s.checkpoint, s.name);
      // This host's own file of a step whose commit (process 0's) is still
      // to come: where the files of a shared step appear only at its commit
      // (a directory), it is waited for, not sent again under a new name.
      const std::optional<int64_t> earlier = StepOfName(s.checkpoint);
      if (!there.ok() && earlier && sent.count(*earlier) != 0) {
        Task<Status> committing = AwaitCopyCommitted(*earlier);
        if ((co_await std::move(committing)).ok()) there = co_await storage_->OpenFile(s.checkpoint, s.name);
      }
      if (there.ok() && (*there)->size() == s.bytes) continue;
      path = source + "/" + s.checkpoint + "/" + s.name;
      AdoptAsOwnFile(&s);
      renamed = true;
    }
    auto map = Mapping::OfFile(path, s.bytes);
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
    images[i].resume_session = journal.Session(images[i].name, images[i].size, crcs[i]);
    images[i].record_session = [&journal, file = images[i].name, bytes = images[i].size,
                                crc = crcs[i]](const std::string& session) {
      return journal.Record(file, bytes, crc, session);
    };
  }
  if (renamed && !multihost()) {
    CO_ASSIGN_OR_RETURN(manifest_bytes, Reserialize(&m, name + "/manifest.json (remote copy)"));
  }
  const auto started = Clock::now();
  CO_ASSIGN_OR_RETURN(std::unique_ptr<storage::CheckpointWriter> writer,
                      co_await storage_->StartCheckpoint(name, /*replace=*/false, /*shared=*/multihost()));
  std::vector<Task<Status>> writes;
  for (const storage::FileImage& image : images) writes.push_back(writer->WriteFile(&image));
  std::vector<Status> written = co_await WhenAll(std::move(writes));
  Status s;
  for (Status& w : written) {
    if (s.ok() && !w.ok()) s = std::move(w);
  }
  uint64_t bytes = 0;
  for (const storage::FileImage& image : images) bytes += image.size;
  if (multihost()) {
    Task<Status> committing = CommitParts(writer.get(), std::move(s), whole, std::move(m), bytes, Clock::now() - started);
    s = co_await std::move(committing);
    // A part sent stays recorded until process 0 commits the step: a copy
    // that has to start again (process 0 failed, or this one was killed)
    // then finds its files complete at the server and sends nothing.
    if (!s.ok() || leader()) {
      Status forgotten = journal.Clear();
      forgotten.IgnoreError();
    }
    co_return s;
  }
  Task<Status> committing = CommitCopy(writer.get(), std::move(s), step, m, std::move(manifest_bytes), bytes,
                                       /*count_as_save=*/true);
  s = co_await std::move(committing);
  // Committed, or aborted (what the sessions hold is deleted): either way
  // they are done with.
  Status forgotten = journal.Clear();
  forgotten.IgnoreError();
  co_return s;
}

Task<Status> ManagerImpl::CommitCopy(storage::CheckpointWriter* writer, Status written, int64_t step,
                                     const format::Manifest& m, std::string manifest_bytes, uint64_t bytes,
                                     bool count_as_save) {
  Status s = std::move(written);
  if (s.ok()) s = co_await writer->Commit(std::move(manifest_bytes));
  if (!s.ok()) {
    Status aborted = co_await writer->Abort();
    aborted.IgnoreError();
    co_return s;
  }
  {
    std::lock_guard lock(mu_);
    committed_.insert(step);
    if (count_as_save) ++stats_.saves_committed;
    stats_.bytes_committed += bytes;
  }
  References refs;
  AddReferences(m, &refs);
  refs_[step] = std::move(refs);
  if (!owns_root()) co_return Status::Ok();
  co_return co_await PruneNow();
}

Task<Status> ManagerImpl::AwaitCopyCommitted(int64_t step) {
  const auto deadline = Clock::now() + options_.multihost.timeout;
  PollBackoff backoff(options_.multihost.process_count, std::chrono::milliseconds(100));
  for (;;) {
    auto bytes = co_await storage_->ReadSmallFile(StepName(step), "manifest.json", format::kMaxManifestBytes);
    if (bytes.ok()) co_return Status::Ok();
    if (bytes.status().code() != StatusCode::kNotFound) co_return bytes.status();
    // Committed and pruned since (remote_keep), or skipped: a newer step is.
    CO_TRY(co_await Refresh(/*remove_debris=*/false));
    {
      std::lock_guard lock(mu_);
      if (committed_.upper_bound(step) != committed_.end()) co_return Status::Ok();
    }
    if (Clock::now() >= deadline) {
      co_return UnavailableError("step " + std::to_string(step) + " was not committed by process 0 within " +
                                 std::to_string(options_.multihost.timeout.count()) + " ms (its log says why)");
    }
    Status slept = co_await loop().Sleep(backoff.Next(deadline));
    slept.IgnoreError();
  }
}

Task<Status> ManagerImpl::ReportFailedPart(int64_t step, Status failure) {
  CO_ASSIGN_OR_RETURN(std::unique_ptr<storage::CheckpointWriter> writer,
                      co_await storage_->StartCheckpoint(StepName(step), /*replace=*/false, /*shared=*/true));
  const Options::MultiHost& mh = options_.multihost;
  co_return co_await writer->WriteSmall(FragmentName(mh.process_index),
                                        MakeFragment({}, step, mh.process_index, mh.process_count, failure));
}

Task<Status> ManagerImpl::CommitParts(storage::CheckpointWriter* writer, Status written, format::Manifest whole,
                                      format::Manifest own, uint64_t bytes, Clock::duration took) {
  const Options::MultiHost& mh = options_.multihost;
  const int64_t step = whole.step;
  const std::string name = StepName(step);
  // This host's part, with its files as sent (renamed where adopted), or
  // its failure: process 0 commits nothing it has not heard of from all.
  Status s = written;
  own.format_version = format::FormatVersionFor(own);
  std::string fragment = MakeFragment(std::move(own), step, mh.process_index, mh.process_count, s);
  Status told = co_await writer->WriteSmall(FragmentName(mh.process_index), std::move(fragment));
  if (s.ok()) s = told;
  if (!leader()) {
    if (s.ok()) {
      std::lock_guard lock(mu_);
      stats_.bytes_committed += bytes;
    }
    co_return s;
  }
  if (!s.ok()) {
    Status aborted = co_await writer->Abort();  // shared: its own files only
    aborted.IgnoreError();
    co_return s;
  }
  // A fragment is this attempt's if it lists the tensors the step's
  // manifest gives its process (an earlier save of the step had others).
  auto expected = std::make_shared<std::map<int, std::map<std::string, uint32_t>>>();
  for (const format::ManifestTensor& t : whole.tensors) {
    std::optional<int> owner = FileOwner(whole.shards[t.shard].name);
    if (owner) (*expected)[*owner][t.name] = t.crc32c;
  }
  GatherSpec spec;
  spec.count = mh.process_count;
  spec.step = step;
  spec.step_name = name;
  // The others send as much as this host did: give them twice its time.
  spec.timeout = std::max(mh.timeout, std::chrono::duration_cast<std::chrono::milliseconds>(took * 2));
  spec.poll = true;
  spec.metadata = whole.metadata;
  spec.accept = [expected](int p, const format::Manifest& f) {
    if (f.metadata.contains("error")) return true;
    const std::map<std::string, uint32_t>& want = (*expected)[p];
    if (f.tensors.size() != want.size()) return false;
    for (const format::ManifestTensor& t : f.tensors) {
      auto it = want.find(t.name);
      if (it == want.end() || it->second != t.crc32c) return false;
    }
    return true;
  };
  spec.waiting_for = "the copy of step " + std::to_string(step) + " to " + root_;
  Task<Result<format::Manifest>> gathering = pipeline::GatherFragments(loop(), writer, std::move(spec));
  Result<format::Manifest> merged = co_await std::move(gathering);
  if (!merged.ok()) {
    Status aborted = co_await writer->Abort();
    aborted.IgnoreError();
    co_return merged.status();
  }
  std::string merged_bytes = format::SerializeManifest(*merged);
  Task<Status> committing = CommitCopy(writer, Status::Ok(), step, *merged, std::move(merged_bytes), bytes,
                                       /*count_as_save=*/true);
  co_return co_await std::move(committing);
}

// ---- seeding the local tier from the remote one (tiers.seed_local) ----

namespace {

constexpr uint64_t kSeedReadPiece = uint64_t{32} << 20;  // ranged reads in parallel

}  // namespace

Status ManagerImpl::SeedFromRemote(int64_t step) {
  RETURN_IF_ERROR(remote_->PinStep(step).status());
  Result<std::string> manifest = remote_->loop().BlockOn(remote_->ReadManifestBytes(step));
  Status s = manifest.ok() ? loop().BlockOn(SeedTask(step, std::move(manifest).value())) : manifest.status();
  remote_->Unpin(step);
  return s;
}

Task<Status> ManagerImpl::ReadWholeFile(std::string checkpoint, std::string file, char* dst, uint64_t size) {
  const std::string where = root_ + "/" + checkpoint + "/" + file;
  auto opened = co_await storage_->OpenFile(checkpoint, file);
  if (!opened.ok()) co_return std::move(opened).status().WithContext(where);
  std::unique_ptr<storage::ReadableFile> f = std::move(opened).value();
  if (f->size() != size) {
    co_return CorruptionError(where + ": " + std::to_string(f->size()) + " bytes, but the manifest says " +
                              std::to_string(size));
  }
  std::vector<Task<Status>> reads;
  for (uint64_t at = 0; at < size; at += kSeedReadPiece) {
    reads.push_back(f->ReadAt(at, dst + at, static_cast<size_t>(std::min(kSeedReadPiece, size - at))));
  }
  std::vector<Status> done = co_await WhenAll(std::move(reads));
  for (Status& r : done) {
    if (!r.ok()) co_return std::move(r).WithContext(where);
  }
  co_return Status::Ok();
}

Task<Status> ManagerImpl::SeedTask(int64_t step, std::string manifest_bytes) {
  const std::string name = StepName(step);
  CO_ASSIGN_OR_RETURN(format::Manifest m,
                      format::ParseManifest(remote_->root() + "/" + name + "/manifest.json", manifest_bytes));
  {
    std::lock_guard lock(mu_);
    if (committed_.count(step) != 0 || in_flight_steps_.count(step) != 0) co_return Status::Ok();  // here already
    in_flight_steps_.insert(step);
  }
  struct Done {
    ManagerImpl* self;
    int64_t step;
    ~Done() {
      std::lock_guard lock(self->mu_);
      self->in_flight_steps_.erase(step);
    }
  } done{this, step};
  // What to copy: this step's files, and the files of earlier steps it uses
  // that this tier lacks (copied as files of this step, under a name of
  // their own). A file of an earlier step this tier has stays referenced.
  std::vector<std::pair<std::string, std::string>> from(m.shards.size());  // (checkpoint, file) there
  std::vector<bool> copy(m.shards.size(), true);
  uint64_t largest = 0;
  bool renamed = false;
  const int index = options_.multihost.process_index;
  for (size_t i = 0; i < m.shards.size(); ++i) {
    format::ManifestShard& s = m.shards[i];
    from[i] = {s.checkpoint.empty() ? name : s.checkpoint, s.name};
    // A host of its own takes back its own part (the others take theirs).
    if (per_host() && FileOwner(s.name) != index) {
      copy[i] = false;
      continue;
    }
    if (!s.checkpoint.empty()) {
      auto here = co_await storage_->OpenFile(s.checkpoint, s.name);
      if (here.ok() && (*here)->size() == s.bytes) {
        copy[i] = false;
        continue;
      }
      AdoptAsOwnFile(&s);
      renamed = true;
    }
    largest = std::max(largest, s.bytes);
  }
  if (renamed) {
    CO_ASSIGN_OR_RETURN(manifest_bytes, Reserialize(&m, name + "/manifest.json (copy of the remote tier's)"));
  }
  CO_ASSIGN_OR_RETURN(Mapping buffer, Mapping::Anonymous(largest));
  CO_ASSIGN_OR_RETURN(std::unique_ptr<storage::CheckpointWriter> writer,
                      co_await storage_->StartCheckpoint(name, /*replace=*/false));
  Status s;
  uint64_t bytes = 0;
  for (size_t i = 0; i < m.shards.size() && s.ok(); ++i) {
    if (!copy[i]) continue;
    const format::ManifestShard& shard = m.shards[i];
    Task<Status> read = remote_->ReadWholeFile(from[i].first, from[i].second, buffer.data(), shard.bytes);
    s = co_await runtime::OnLoop(remote_->loop(), std::move(read));
    if (!s.ok()) break;
    // The bytes are checked before they are written here.
    const uint32_t crc = format::Crc32c(buffer.data(), shard.bytes);
    if (crc != shard.crc32c) {
      s = CorruptionError(remote_->root() + "/" + from[i].first + "/" + from[i].second + ": CRC32C " +
                          format::Crc32cToHex(crc) + ", but the manifest of " + name + " says " +
                          format::Crc32cToHex(shard.crc32c));
      break;
    }
    runtime::AsyncEvent crc_ready;
    crc_ready.Set();
    storage::FileImage image;
    image.name = shard.name;
    image.size = shard.bytes;
    image.crc32c = &crc;
    image.crc_ready = &crc_ready;
    if (shard.bytes > 0) image.segments.push_back({0, buffer.data(), shard.bytes, shard.bytes});
    Task<Status> write = writer->WriteFile(&image);
    s = co_await std::move(write);
    bytes += shard.bytes;
  }
  if (s.ok() && per_host()) {  // its part, without local copies
    format::Manifest part;
    part.step = step;
    part.created = m.created;
    part.writer = m.writer;
    part.metadata = {{"process_index", index}, {"process_count", options_.multihost.process_count}};
    s = co_await writer->WriteSmall(kLocalPartFile, format::SerializeManifest(part));
  }
  Task<Status> committing = CommitCopy(writer.get(), std::move(s), step, m, std::move(manifest_bytes), bytes,
                                       /*count_as_save=*/false);
  co_return co_await std::move(committing);
}

}  // namespace ckptio::pipeline
