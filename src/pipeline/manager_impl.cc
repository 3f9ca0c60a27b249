#include "pipeline/manager_impl.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "base/status_macros.h"
#include "runtime/when_all.h"
#include "format/crc32c.h"
#include "format/manifest.h"
#include "pipeline/reader.h"
#include "pipeline/retention.h"
#include "pipeline/sigterm.h"
#include "pipeline/snapshot.h"
#include "runtime/spawn.h"
#include "storage/open_storage.h"

namespace ckptio::pipeline {
namespace {

// Chunk sizes: the snapshot copies 1 MiB at a time (fits L2, so a fused CRC
// reads it back from cache); background CRC jobs take 8 MiB (few pool round
// trips, yet short enough not to hold up a trainer's urgent copy work; the
// same pieces as the content hash's, so one job computes both).
constexpr size_t kCopyChunk = size_t{1} << 20;
constexpr size_t kCrcChunk = format::kHashPiece;

Task<void> NoWork() { co_return; }

double SecondsSince(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// The bound of "auto" staging: saves may take up to half the machine's
// memory before they are written straight from the caller's buffers.
uint64_t HalfOfMemory() {
  const uint64_t memory = PhysicalMemory();
  return memory == 0 ? uint64_t{2} << 30 : memory / 2;
}

}  // namespace

uint64_t PhysicalMemory() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page_size = ::sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page_size <= 0) return 0;
  return static_cast<uint64_t>(pages) * static_cast<uint64_t>(page_size);
}

std::string FormatBytes(uint64_t n) {
  char buf[64];
  if (n >= (uint64_t{1} << 40)) {
    std::snprintf(buf, sizeof buf, "%.2f TiB", n / double(uint64_t{1} << 40));
  } else if (n >= (uint64_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f GiB", n / double(uint64_t{1} << 30));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f MiB", n / double(1 << 20));
  }
  return buf;
}

void SaveState::MarkReleased() {
  {
    std::lock_guard lock(mu);
    released = true;
  }
  cv.notify_all();
}

void SaveState::MarkSnapshotTaken(Status s) {
  {
    std::lock_guard lock(mu);
    snapshot_status = std::move(s);
    snapshot_taken = true;
  }
  cv.notify_all();
}

void SaveState::Finish(Status s) {
  {
    std::lock_guard lock(mu);
    status = std::move(s);
    done = true;
  }
  cv.notify_all();
}

Result<std::unique_ptr<ManagerImpl>> ManagerImpl::Open(storage::RootUrl url, Options options, bool read_only,
                                                       std::shared_ptr<Barrier> barrier) {
  if (options.incremental && !read_only) {
    if (options.overwrite) {
      return InvalidArgumentError("incremental saves cannot be combined with overwrite: replacing a step would "
                                  "delete the shards later steps refer to");
    }
  }
  if (options.on_busy == OnBusy::kSkip && options.multihost.process_count > 1 && !read_only) {
    // The choice is each process's own (its staging, its saves in flight),
    // so one would skip a step that the others save, and their save of it
    // would wait at the barrier for a fragment that never comes.
    return InvalidArgumentError("on_busy \"skip\" with multihost.process_count " +
                                std::to_string(options.multihost.process_count) +
                                ": one process could skip a step that the others save, and their save of it would "
                                "fail at the barrier after multihost.timeout; use on_busy \"wait\" in a multi-host "
                                "job");
  }
  std::unique_ptr<ManagerImpl> m(new ManagerImpl(std::move(url), std::move(options)));
  m->read_only_ = read_only;
  if (!m->options_.trace.path.empty()) m->tracer_ = std::make_unique<runtime::Tracer>(m->options_.trace.path);
  m->pool_ = std::make_unique<runtime::CpuPool>(static_cast<size_t>(std::max(m->options_.threads, 0)));
  ASSIGN_OR_RETURN(m->loop_thread_, runtime::LoopThread::Start());
  if (m->tracer_) m->loop().BlockOn(m->SetLoopTracer());
  RETURN_IF_ERROR(m->loop().BlockOn(m->OpenStorage(/*create=*/!read_only)));
  if (read_only) {
    RETURN_IF_ERROR(m->loop().BlockOn(m->Refresh(/*remove_debris=*/false)));
    RETURN_IF_ERROR(m->OpenRemoteTier(/*read_only=*/true));
    return m;
  }
  RETURN_IF_ERROR(m->SetUpMultihost(std::move(barrier)));
  if (m->per_host()) {
    // Each host locks and clears its own local tier, then the hosts learn
    // which steps every local tier holds (a failure to open is swapped too,
    // so that the others fail at once instead of at their timeout).
    Status opened = m->loop().BlockOn(m->LockTask());
    if (opened.ok()) opened = m->loop().BlockOn(m->Refresh(/*remove_debris=*/true));
    // The remote tier first: a barrier that cannot exchange bytes swaps them there.
    if (opened.ok()) opened = m->OpenRemoteTier(/*read_only=*/false);
    RETURN_IF_ERROR(m->loop().BlockOn(m->AgreeOnLocalSteps(std::move(opened))));
  } else if (m->owns_root()) {  // the one writer of the root (process 0 of a multi-host job)
    RETURN_IF_ERROR(m->loop().BlockOn(m->LockTask()));
    RETURN_IF_ERROR(m->loop().BlockOn(m->Refresh(/*remove_debris=*/true)));
  } else {
    RETURN_IF_ERROR(m->loop().BlockOn(m->Refresh(/*remove_debris=*/false)));
  }
  // Nobody writes before process 0 has cleared the debris of earlier runs.
  if (m->shared_root()) RETURN_IF_ERROR(m->loop().BlockOn(m->BarrierWait("open")));
  runtime::Loop* loop = &m->loop();
  StagingPool::GrownFn on_grown;
  if (m->options_.io.register_buffers) {
    // Pinning pages for io_uring faults them in; do it once they are
    // resident, on the loop thread, off the trainer's path, again each time
    // the resident part grows. (This may run before staging_ is assigned:
    // use only what it is given.)
    on_grown = [loop](char* base, uint64_t resident) {
      loop->Post([loop, base, resident] {
        iovec region{base, resident};
        // Best effort: without registration writes still work, unpinned.
        loop->RegisterBuffers({&region, 1}).IgnoreError();
      });
    };
  }
  // An explicit staging_memory is faulted in at once, in the background;
  // "auto" (0) grows to what the saves take, up to half the memory.
  const uint64_t explicit_bytes = m->options_.staging_memory;
  const uint64_t limit = explicit_bytes != 0 ? explicit_bytes : HalfOfMemory();
  // A restart (the root holds checkpoints) restores first: see restart_hold_.
  const bool restart = explicit_bytes != 0 && m->LatestStep().has_value();
  ASSIGN_OR_RETURN(m->staging_, StagingPool::Create(limit, explicit_bytes, std::move(on_grown), /*held=*/restart));
  m->restart_hold_ = restart;
  if (!m->per_host()) RETURN_IF_ERROR(m->OpenRemoteTier(/*read_only=*/false));
  m->StartReplicator();
  if (m->options_.preemption.on_sigterm) {
    ManagerImpl* self = m.get();
    ASSIGN_OR_RETURN(m->sigterm_, SigtermWatcher::Install([self] { self->HandleSigterm(); }));
  }
  return m;
}

Task<void> ManagerImpl::SetLoopTracer() {
  loop().set_tracer(tracer_.get());
  co_return;
}

Task<Status> ManagerImpl::OpenStorage(bool create) {
  CO_ASSIGN_OR_RETURN(storage_, co_await storage::OpenStorage(loop(), *pool_, url_, options_, create));
  co_return Status::Ok();
}

ManagerImpl::~ManagerImpl() {
  sigterm_.reset();  // no preemption handling while tearing down
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return in_flight_ == 0; });
  }
  if (snapshot_thread_.joinable()) {  // idle now: every admitted save has ended
    {
      std::lock_guard lock(snapshot_mu_);
      snapshot_stop_ = true;
    }
    snapshot_cv_.notify_all();
    snapshot_thread_.join();
  }
  StopReplicator();  // after the saves: they queue copies
  remote_.reset();
  if (staging_) staging_->StopPrefault();  // no more posts to the loop from it
  if (loop_thread_) loop().BlockOn(CloseStorage());
  loop_thread_.reset();
  pool_.reset();
  staging_.reset();
  if (tracer_) {
    Status s = tracer_->Flush();
    if (!s.ok()) std::fprintf(stderr, "ckptio: %s\n", s.ToString().c_str());
  }
}

Task<void> ManagerImpl::CloseStorage() {
  storage_.reset();
  co_return;
}

Task<Status> ManagerImpl::LockTask() { co_return storage_->LockForWriting(); }

Status ManagerImpl::CheckWritable(std::string_view what) const {
  if (!read_only_) return Status::Ok();
  return FailedPreconditionError("cannot " + std::string(what) + ": " + root_ + " was opened read-only");
}

Status ManagerImpl::RefreshNow() { return loop().BlockOn(Refresh(/*remove_debris=*/false)); }

void ManagerImpl::WaitUntilReady() {
  EndRestartHold();  // asked for: the pre-fault goes ahead now
  if (staging_) staging_->WaitPrefaulted();
}

Task<Status> ManagerImpl::Refresh(bool remove_debris) {
  CO_ASSIGN_OR_RETURN(std::vector<storage::Entry> entries, co_await storage_->List());
  std::set<int64_t> committed;
  std::vector<std::pair<int64_t, std::string>> unfinished;  // (step, name)
  const std::string& prefix = options_.prefix;
  for (const storage::Entry& e : entries) {
    if (e.name.compare(0, prefix.size(), prefix) != 0) continue;
    size_t digits = 0;
    while (prefix.size() + digits < e.name.size() && std::isdigit(static_cast<unsigned char>(e.name[prefix.size() + digits]))) ++digits;
    if (digits == 0 || digits > 18) continue;
    int64_t step = std::stoll(e.name.substr(prefix.size(), digits));
    std::string rest = e.name.substr(prefix.size() + digits);
    // A step that cannot be examined is reported, never silently left out.
    if (rest.empty() && !e.problem.ok()) co_return e.problem;
    if (rest.empty() && e.committed) {
      committed.insert(step);
    } else if (rest.empty() || rest.rfind(storage::kTmpMarker, 0) == 0) {
      unfinished.emplace_back(step, e.name);
    }
  }
  {
    std::lock_guard lock(mu_);
    committed_ = committed;
  }
  std::erase_if(refs_, [&](const auto& kv) { return committed.count(kv.first) == 0; });
  if (!remove_debris) co_return Status::Ok();
  // Debris: anything tmp-marked (we hold the writer lock, so no save of ours
  // is in flight), and unfinished steps older than the newest commit (a
  // remote store has no tmp names; a newer one may still be in flight). In a
  // multi-host job other processes may be writing a newer step already:
  // only what is older than the newest commit is debris there.
  // A step directory without a manifest may also be a retired checkpoint
  // (pruned, but holding files that kept steps refer to): its referenced
  // files stay.
  int64_t newest = committed.empty() ? -1 : *committed.rbegin();
  bool references_known = false;
  References referenced;
  for (const auto& [step, name] : unfinished) {
    bool tmp = name.find(storage::kTmpMarker) != std::string::npos;
    if ((!tmp || shared_root()) && step >= newest) continue;
    Status s;
    if (tmp) {
      s = co_await storage_->Remove(name);
    } else {
      if (!references_known) {
        CO_TRY(co_await LoadReferences());
        referenced = Referenced();
        references_known = true;
      }
      s = co_await RemoveUnreferenced(name, /*prune=*/false, referenced);
    }
    if (!s.ok()) co_return s.WithContext("cannot remove the debris of an unfinished save in " + root_);
  }
  co_return Status::Ok();
}

Result<SaveHandle> ManagerImpl::Skip(std::shared_ptr<SaveState> state, const std::string& why) {
  state->skipped = true;
  ++stats_.saves_skipped;
  state->Finish(ResourceExhaustedError("save of step " + std::to_string(state->step) + " skipped: " + why));
  return SaveHandle(std::move(state));
}

Result<SaveHandle> ManagerImpl::Save(int64_t step, std::span<const TensorRef> tensors, std::string metadata_json,
                                     std::shared_ptr<const void> keep_alive,
                                     std::optional<SnapshotMode> snapshot, SnapshotCheck check) {
  const Clock::time_point start = Clock::now();
  EndRestartHold();
  auto job = std::make_shared<SaveJob>();
  job->state = std::make_shared<SaveState>(step);
  job->keep_alive = std::move(keep_alive);
  job->metadata = nlohmann::json::parse(metadata_json, nullptr, /*allow_exceptions=*/false);
  if (!job->metadata.is_object()) {
    return InvalidArgumentError("save of step " + std::to_string(step) + ": metadata must be a JSON object, got: " +
                                metadata_json.substr(0, 80));
  }
  RETURN_IF_ERROR(CheckWritable("save step " + std::to_string(step)));
  ASSIGN_OR_RETURN(job->plan, PlanSave(step, tensors, options_, snapshot, storage_->AddressModulus()));
  if (job->plan.staging_bytes > staging_->capacity()) {
    // More than staging can ever hold: written straight from the caller's
    // buffers (staging holds the shard headers only), and Save() returns
    // once they are written, so the caller may change them afterwards. The
    // trainer waits for the write instead of a copy: said once.
    const uint64_t wanted = job->plan.staging_bytes;
    ASSIGN_OR_RETURN(job->plan, PlanSave(step, tensors, options_, SnapshotMode::kBorrow, storage_->AddressModulus()));
    if (job->plan.staging_bytes > staging_->capacity()) {
      return ResourceExhaustedError("save of step " + std::to_string(step) + ": its shard headers alone need " +
                                    FormatBytes(job->plan.staging_bytes) + ", more than staging_memory (" +
                                    FormatBytes(staging_->capacity()) + ")");
    }
    job->written_before_return = true;
    if (!warned_written_before_return_.exchange(true)) {
      std::fprintf(stderr,
                   "ckptio: the save of step %lld needs %s of staging memory, more than staging_memory (%s): "
                   "it is written straight from your buffers and save() returns once it is written, so "
                   "training waits for the write. Raise staging_memory (config key \"staging_memory\") to "
                   "overlap saves with training. (said once per manager)\n",
                   static_cast<long long>(step), FormatBytes(wanted).c_str(),
                   FormatBytes(staging_->capacity()).c_str());
    }
  }
  {
    std::unique_lock lock(mu_);
    if (preempting_ && std::this_thread::get_id() != final_save_thread_) {
      return CancelledError("save of step " + std::to_string(step) +
                            " refused: SIGTERM arrived, the manager is finishing its saves");
    }
    if (!pending_errors_.empty()) {
      const bool one = pending_errors_.size() == 1;
      Status e = TakePendingErrors();
      return one ? std::move(e).WithContext("an earlier background save failed") : e;
    }
    if (committed_.count(step) != 0 && !options_.overwrite) {
      return AlreadyExistsError("checkpoint step " + std::to_string(step) + " already exists in " + root_ +
                                " (set overwrite to replace it)");
    }
    if (in_flight_steps_.count(step) != 0) {
      return AlreadyExistsError("a save of step " + std::to_string(step) + " is already in progress");
    }
    for (;;) {
      if (in_flight_ < options_.max_in_flight) {
        job->staging_offset = staging_->TryAllocate(job->plan.staging_bytes);
        if (job->staging_offset) break;
      }
      if (options_.on_busy == OnBusy::kSkip) {
        return Skip(job->state, in_flight_ >= options_.max_in_flight
                                    ? std::to_string(in_flight_) + " saves already in flight (max_in_flight)"
                                    : "not enough free staging memory for " + FormatBytes(job->plan.staging_bytes));
      }
      cv_.wait(lock);
    }
    ++in_flight_;
    in_flight_steps_.insert(step);
    job->previous = std::exchange(last_job_, job);
  }
  job->region = staging_->base() + *job->staging_offset;
  job->check = std::move(check);
  {
    std::lock_guard lock(job->state->mu);
    job->state->timings.bytes = job->plan.checkpoint_bytes;
  }
  const bool background =
      !job->plan.borrow && snapshot.value_or(options_.snapshot) == SnapshotMode::kBackground;
  if (background) {
    // The copy waits its turn on the snapshot thread (admission order), and
    // the caller goes back to training: it changes nothing it saved until
    // WaitSnapshot().
    {
      std::lock_guard lock(snapshot_mu_);
      snapshot_queue_.push_back(job);
      if (!snapshot_thread_.joinable()) snapshot_thread_ = std::thread([this] { SnapshotThread(); });
    }
    snapshot_cv_.notify_all();
  } else {
    if (job->written_before_return) storage_->SetWaitedOn(true);  // before any write starts
    SnapshotAndPost(job, Clock::now());
  }
  const Clock::time_point returned = Clock::now();
  if (tracer_) tracer_->Span(runtime::Track::kTrainer, "Save(" + std::to_string(step) + ")", start, returned);
  {
    std::lock_guard lock(job->state->mu);
    job->state->timings.snapshot_seconds = std::chrono::duration<double>(returned - start).count();
  }
  if (job->written_before_return) {
    std::unique_lock lock(job->state->mu);
    job->state->cv.wait(lock, [&] { return job->state->released || job->state->done; });
    storage_->SetWaitedOn(false);
    job->state->timings.snapshot_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  }
  return SaveHandle(job->state);
}

void ManagerImpl::SnapshotAndPost(const std::shared_ptr<SaveJob>& job, Clock::time_point snapshot_start) {
  TakeSnapshot(job.get());
  if (!job->plan.borrow) {
    if (job->check) job->snapshot_status = job->check();
    // A copy no longer needs the caller's buffers; borrowed ones stay held
    // until written (ReleaseStaging).
    job->keep_alive.reset();
  }
  job->check = nullptr;  // it may hold the caller's objects too
  job->snapshot_end = Clock::now();
  if (tracer_) {
    tracer_->Span(runtime::Track::kSnapshot, "snapshot " + std::to_string(job->plan.step), snapshot_start,
                  job->snapshot_end, "{\"bytes\":" + std::to_string(job->plan.checkpoint_bytes) + "}");
  }
  if (!job->plan.borrow) job->state->MarkSnapshotTaken(job->snapshot_status);
  ManagerImpl* self = this;
  loop().Post([self, job] { runtime::Spawn(self->RunSave(job)); });
}

void ManagerImpl::SnapshotThread() {
  std::unique_lock lock(snapshot_mu_);
  for (;;) {
    snapshot_cv_.wait(lock, [this] { return snapshot_stop_ || !snapshot_queue_.empty(); });
    if (snapshot_queue_.empty()) return;  // stopping, nothing left
    std::shared_ptr<SaveJob> job = std::move(snapshot_queue_.front());
    snapshot_queue_.pop_front();
    snapshot_busy_ = true;
    lock.unlock();
    SnapshotAndPost(job, Clock::now());
    job.reset();
    lock.lock();
    snapshot_busy_ = false;
    snapshot_cv_.notify_all();
  }
}

void ManagerImpl::WaitSnapshots() {
  std::unique_lock lock(snapshot_mu_);
  snapshot_cv_.wait(lock, [this] { return snapshot_queue_.empty() && !snapshot_busy_; });
}

void ManagerImpl::TakeSnapshot(SaveJob* job) {
  const SavePlan& plan = job->plan;
  std::vector<Chunk> copy;
  if (!plan.borrow) copy = MakeChunks(plan, job->region, kCopyChunk);
  if (!plan.borrow && options_.snapshot_crc == SnapshotCrc::kFused) {
    std::vector<uint32_t> crc(copy.size(), 0);
    CopySnapshot(*pool_, plan, job->region, copy, &crc);
    job->tensor_crc = CombineChunkCrcs(plan, copy, crc);
    job->crc_fused = true;
    if (options_.incremental) {  // the content hash, in the background
      job->hash_chunks = MakeChunks(plan, job->region, format::kHashPiece);
      job->chunk_hash.assign(job->hash_chunks.size(), {});
    }
  } else {
    // By default the CRC32C runs in a background pass over staging (or over
    // the borrowed buffers) while the shards are written: the trainer waits
    // for the copy alone, the figure that matters (DESIGN.md).
    CopySnapshot(*pool_, plan, job->region, copy, nullptr);
    job->crc_chunks = MakeChunks(plan, job->region, kCrcChunk);
    job->chunk_crc.assign(job->crc_chunks.size(), 0);
    if (options_.incremental) job->chunk_hash.assign(job->crc_chunks.size(), {});
  }
  job->images = MakeImages(plan, job->region);
  // Each shard's whole-file CRC32C lands in shard_crc once crc_ready is set
  // (a remote store sends it with an upload's last bytes).
  job->shard_crc.assign(plan.shards.size(), 0);
  for (size_t i = 0; i < job->images.size(); ++i) {
    job->images[i].progress = &job->state->bytes_written;
    job->images[i].crc32c = &job->shard_crc[i];
    job->images[i].crc_ready = &job->crc_ready;
  }
}

Task<void> ManagerImpl::ComputeCrcs(SaveJob* job) {
  runtime::ScopedSpan span(tracer_.get(), runtime::Track::kChecksum, "CRC32C " + std::to_string(job->plan.step));
  const bool hash = options_.incremental;
  if (!job->crc_fused) {
    // One lane for the CRC alone: it reads at ~30 GB/s, many times what the
    // writes take, and a second lane only spends CPU (the trainer's, in a
    // loop that computes on every core) on memory bandwidth: 45-48 against
    // 53-61 ms per GiB here. The content hash of an incremental save, which
    // the writes wait for, keeps every lane.
    co_await ComputeChunkCrcs(*pool_, &job->crc_chunks, &job->chunk_crc, hash ? pool_->size() : 1,
                              hash ? &job->chunk_hash : nullptr);
    job->tensor_crc = CombineChunkCrcs(job->plan, job->crc_chunks, job->chunk_crc);
    if (hash) job->tensor_hash = CombineChunkHashes(job->plan, job->crc_chunks, job->chunk_hash);
  } else if (hash) {
    co_await ComputeChunkCrcs(*pool_, &job->hash_chunks, nullptr, pool_->size(), &job->chunk_hash);
    job->tensor_hash = CombineChunkHashes(job->plan, job->hash_chunks, job->chunk_hash);
  }
  // An incremental save decides what to write first (PlanIncremental).
  if (!hash) FinishCrcs(job);
}

void ManagerImpl::FinishCrcs(SaveJob* job) {
  std::vector<uint32_t> shard;
  if (job->reusing) {
    std::vector<uint32_t> crc;
    for (size_t i : job->changed_from) crc.push_back(job->tensor_crc[i]);
    shard = ShardCrcs(job->changed, crc);
  } else {
    shard = ShardCrcs(job->plan, job->tensor_crc);
  }
  job->shard_crc.resize(shard.size());
  std::copy(shard.begin(), shard.end(), job->shard_crc.begin());  // in place: images point here
  job->crc_ready.Set();
}

Task<void> ManagerImpl::RunSave(std::shared_ptr<SaveJob> job) {
  const int64_t step = job->plan.step;
  Status s = co_await Persist(job.get());
  ReleaseStaging(job.get());
  if (job->base) Unpin(job->base->step);
  if (!s.ok()) s = std::move(s).WithContext("cannot save step " + std::to_string(step) + " to " + root_);
  {
    std::lock_guard lock(mu_);
    in_flight_steps_.erase(step);
    if (s.ok()) {
      committed_.insert(step);
      ++stats_.saves_committed;
      stats_.bytes_committed += job->reusing ? job->changed.checkpoint_bytes : job->plan.checkpoint_bytes;
      for (size_t i = 0; i < job->reuse.size(); ++i) {
        if (job->reuse[i]) stats_.bytes_reused += job->plan.specs[i].bytes;
      }
      if (options_.incremental && job->committed && (!base_ || base_->step <= step)) base_ = job->committed;
    } else {
      ++stats_.saves_failed;
      pending_errors_.push_back(s);
    }
  }
  if (s.ok()) refs_[step] = std::move(job->references);
  job->ended.Set();
  job->previous.reset();
  {
    std::lock_guard lock(job->state->mu);
    job->state->timings.persist_seconds = SecondsSince(job->snapshot_end);
  }
  const bool committed = s.ok();
  job->state->Finish(std::move(s));  // the caller waits for the commit, not for pruning
  if (committed && remote_ && step % options_.tiers.remote_every == 0) EnqueueReplication(step);
  if (committed && owns_root()) {
    Status p = co_await PruneNow();
    if (!p.ok()) {
      std::lock_guard lock(mu_);
      pending_errors_.push_back(std::move(p));
    }
  }
  {
    std::lock_guard lock(mu_);
    --in_flight_;
  }
  cv_.notify_all();
}

void ManagerImpl::ReleaseStaging(SaveJob* job) {
  // Nothing reads the caller's buffers any more (written, or failed).
  job->keep_alive.reset();
  job->state->MarkReleased();
  if (!job->staging_offset) return;
  staging_->Free(*job->staging_offset, job->plan.staging_bytes);
  job->staging_offset.reset();
  { std::lock_guard lock(mu_); }  // order the release before waiters re-check
  cv_.notify_all();
}

Task<Status> ManagerImpl::WriteShards(SaveJob* job, storage::CheckpointWriter* writer) {
  // A snapshot its check refused (the caller's buffers changed during the
  // copy) is never written: the save fails as a write would.
  if (!job->snapshot_status.ok()) co_return job->snapshot_status;
  // An incremental save knows what to write once every tensor is hashed;
  // otherwise the checksums are computed while the shards are written.
  const bool incremental = options_.incremental;
  if (incremental) {
    co_await ComputeCrcs(job);
    CO_TRY(co_await PlanIncremental(job));
  }
  std::vector<Task<Status>> writes;
  for (const storage::FileImage& image : job->images) writes.push_back(TimedWrite(writer, &image, job->plan.step));
  // Named before the co_await (g++ 12 and temporaries, see STYLE.md).
  Task<void> crcs = incremental ? NoWork() : ComputeCrcs(job);
  Task<std::vector<Status>> all_writes = WhenAll(std::move(writes));
  auto both = WhenAll(std::move(crcs), std::move(all_writes));
  auto done = co_await std::move(both);
  for (Status& r : std::get<1>(done)) CO_TRY(r);
  co_return Status::Ok();
}

Task<Status> ManagerImpl::TimedWrite(storage::CheckpointWriter* writer, const storage::FileImage* image,
                                     int64_t step) {
  runtime::ScopedSpan span(tracer_.get(), runtime::Track::kWrite, image->name + " (step " + std::to_string(step) + ")");
  if (tracer_) span.set_args("{\"bytes\":" + std::to_string(image->size) + "}");
  co_return co_await writer->WriteFile(image);
}

Result<format::Manifest> ManagerImpl::BuildManifest(SaveJob* job, format::Chunks chunks) {
  const int64_t step = job->plan.step;
  format::Manifest m =
      !options_.incremental ? MakeManifest(job->plan, job->tensor_crc, job->shard_crc, job->metadata)
      : job->reusing ? MakeIncrementalManifest(job->plan, job->changed, job->changed_from, job->tensor_crc,
                                               job->tensor_hash, job->shard_crc, job->reuse, *job->base, job->metadata)
                     : MakeManifest(job->plan, job->tensor_crc, job->shard_crc, job->metadata, &job->tensor_hash);
  RETURN_IF_ERROR(format::ValidateManifest(StepName(step) + "/manifest.json", m, chunks));
  // What the next incremental save of this process compares against: what
  // it wrote itself (and, on a host of its own, its local copies).
  job->committed = std::make_shared<IncrementalBase>(IncrementalBase{step, StepName(step), m});
  AddReferences(m, &job->references);
  return m;
}

Task<Status> ManagerImpl::Persist(SaveJob* job) {
  if (per_host()) co_return co_await PersistPerHost(job);
  if (multihost()) co_return co_await PersistShared(job);
  const int64_t step = job->plan.step;
  CO_TRY(co_await CheckNotReferenced(step));
  CO_ASSIGN_OR_RETURN(std::unique_ptr<storage::CheckpointWriter> writer,
                      co_await storage_->StartCheckpoint(StepName(step), options_.overwrite));
  Status s = co_await WriteShards(job, writer.get());
  // Every byte is durable (or failed): staging can serve the next save.
  ReleaseStaging(job);
  std::string manifest_json;
  if (s.ok()) {
    Result<format::Manifest> m = BuildManifest(job, format::Chunks::kComplete);
    if (m.ok()) {
      manifest_json = format::SerializeManifest(*m);
    } else {
      s = m.status();
    }
  }
  if (job->previous) {
    co_await job->previous->ended.Wait();  // commits happen in admission order
    job->previous.reset();
  }
  if (s.ok()) {
    runtime::ScopedSpan span(tracer_.get(), runtime::Track::kCommit, "commit " + std::to_string(step));
    s = co_await writer->Commit(std::move(manifest_json));
  }
  if (!s.ok()) {
    Status aborted = co_await writer->Abort();
    aborted.IgnoreError();  // the write or commit error is the one to report
  }
  co_return s;
}

Task<Status> ManagerImpl::PruneNow() {
  co_await prune_lock_.Acquire();
  runtime::AsyncSemaphore::Held held(&prune_lock_);
  runtime::ScopedSpan span(tracer_.get(), runtime::Track::kPrune, "prune");
  std::vector<int64_t> doomed;
  {
    std::lock_guard lock(mu_);
    std::set<int64_t> untouchable = in_flight_steps_;
    untouchable.insert(readers_.begin(), readers_.end());
    doomed = StepsToPrune(committed_, options_.keep, options_.keep_every, untouchable);
    // Gone from the index before the first byte is deleted, so no reader
    // can pin a checkpoint that is being removed.
    for (int64_t step : doomed) committed_.erase(step);
  }
  if (doomed.empty() && retired_.empty()) co_return Status::Ok();
  // Files of a doomed step that a kept step refers to (incremental saves)
  // stay; so every kept step's references must be known first.
  Status known = co_await LoadReferences();
  if (!known.ok()) {
    std::lock_guard lock(mu_);
    committed_.insert(doomed.begin(), doomed.end());  // pruned next time
    co_return std::move(known).WithContext("cannot prune " + root_);
  }
  for (int64_t step : doomed) refs_.erase(step);
  const References referenced = Referenced();
  Status first;
  for (int64_t step : doomed) {
    Status s = co_await RemoveUnreferenced(StepName(step), /*prune=*/true, referenced);
    std::lock_guard lock(mu_);
    if (s.ok()) {
      ++stats_.checkpoints_pruned;
    } else if (first.ok()) {
      first = std::move(s).WithContext("cannot prune step " + std::to_string(step) + " in " + root_);
    }
  }
  Status collected = co_await CollectRetired(referenced);
  if (first.ok() && !collected.ok()) first = std::move(collected).WithContext("cannot prune " + root_);
  co_return first;
}

Status ManagerImpl::WaitUntilFinished() {
  storage_->SetWaitedOn(true);
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return in_flight_ == 0; });
  storage_->SetWaitedOn(false);
  return TakePendingErrors();
}

Status JoinFailures(std::vector<Status> errors, std::string_view what) {
  if (errors.size() <= 1) return errors.empty() ? Status::Ok() : std::move(errors[0]);
  // Every failure, in the order they happened: none is dropped for being
  // second (a full disk fails several saves in a row).
  std::string message = std::to_string(errors.size()) + " " + std::string(what) + " failed: ";
  for (size_t i = 0; i < errors.size(); ++i) message += (i > 0 ? "; " : "") + errors[i].message();
  return Status(errors[0].code(), std::move(message));
}

Status ManagerImpl::TakePendingErrors() {
  return JoinFailures(std::exchange(pending_errors_, {}), "background saves");
}

Task<Status> ManagerImpl::DeleteTask(int64_t step) {
  CO_TRY(co_await LoadReferences());
  refs_.erase(step);
  const References referenced = Referenced();
  CO_TRY(co_await RemoveUnreferenced(StepName(step), /*prune=*/false, referenced));
  co_return co_await CollectRetired(referenced);
}

Status ManagerImpl::Delete(int64_t step) {
  RETURN_IF_ERROR(CheckWritable("delete step " + std::to_string(step)));
  {
    std::lock_guard lock(mu_);
    if (in_flight_steps_.count(step) != 0) {
      return FailedPreconditionError("cannot delete step " + std::to_string(step) + ": a save of it is in flight");
    }
    if (readers_.count(step) != 0) {
      return FailedPreconditionError("cannot delete step " + std::to_string(step) + ": it is being read");
    }
    if (committed_.erase(step) == 0) {
      return NotFoundError("no committed checkpoint of step " + std::to_string(step) + " in " + root_);
    }
    if (base_ && base_->step == step) base_.reset();
  }
  Status s = loop().BlockOn(DeleteTask(step));
  return s.ok() ? s : std::move(s).WithContext("cannot delete step " + std::to_string(step));
}

Status ManagerImpl::Prune() {
  RETURN_IF_ERROR(CheckWritable("prune"));
  return loop().BlockOn(PruneNow());
}

ManagerStats ManagerImpl::stats() const {
  ManagerStats s;
  {
    std::lock_guard lock(mu_);
    s = stats_;
  }
  s.storage_retries = storage_->retries() + (remote_ ? remote_->storage_->retries() : 0);
  s.bytes_resumed = storage_->bytes_resumed() + (remote_ ? remote_->storage_->bytes_resumed() : 0);
  // What restores read from the remote tier: the files of a step of this
  // tier that this host lacked, and the steps read there whole.
  s.bytes_read_remote =
      bytes_read_remote_.load(std::memory_order_relaxed) + (remote_ ? remote_->bytes_read_.load() : 0);
  s.staging_resident_bytes = staging_ ? staging_->resident_bytes() : 0;
  return s;
}

}  // namespace ckptio::pipeline
