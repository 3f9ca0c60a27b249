#pragma once
// ManagerImpl: the machinery behind CheckpointManager.
//
// Threads: the public methods run on the caller's thread. Save() admits the
// save (staging, max_in_flight), takes the snapshot on the caller's thread
// plus the CPU pool (snapshot "background": on the snapshot thread, after
// Save() returned), and posts the rest to the loop thread, which writes the
// shards, commits in admission order, prunes, and finishes the handle. Other
// public methods run their I/O on the loop thread through Loop::BlockOn.
// Shared state is guarded by mu_, which is never held across a co_await or a
// BlockOn (the loop thread takes it too).

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "pipeline/incremental.h"
#include "pipeline/reader.h"
#include "pipeline/save_plan.h"
#include "pipeline/sigterm.h"
#include "pipeline/staging.h"
#include "runtime/async_sync.h"
#include "runtime/cpu_pool.h"
#include "runtime/loop.h"
#include "runtime/trace.h"
#include "storage/open_storage.h"
#include "storage/storage.h"

namespace ckptio::pipeline {

using Clock = std::chrono::steady_clock;

// "1.50 GiB", "64.00 MiB": sizes in messages.
std::string FormatBytes(uint64_t n);
// The machine's memory in bytes (0 if unknown).
uint64_t PhysicalMemory();
// Failures as one Status: OK if none, the one if one, else the first one's
// code and every message, oldest first ("3 <what> failed: a; b; c").
Status JoinFailures(std::vector<Status> errors, std::string_view what);

// What a SaveHandle sees. Written by the loop thread, read by any.
struct SaveState {
  explicit SaveState(int64_t s) : step(s) {}
  const int64_t step;
  bool skipped = false;  // set before the handle is returned
  std::atomic<uint64_t> bytes_written{0};
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool done = false;     // guarded by mu
  bool released = false;  // the caller's buffers are no longer read; guarded by mu
  // The copy is taken (in Save(), or later on the snapshot thread in
  // background mode; never set in borrow mode), and its SnapshotCheck's
  // status. Guarded by mu.
  bool snapshot_taken = false;
  Status snapshot_status;
  Status status;         // guarded by mu
  SaveTimings timings;   // guarded by mu

  void MarkReleased();
  void MarkSnapshotTaken(Status s);
  void Finish(Status s);
};

// One save on its way through the loop thread.
struct SaveJob {
  std::shared_ptr<SaveState> state;
  SavePlan plan;
  nlohmann::json metadata;
  std::optional<uint64_t> staging_offset;  // the save's staging region while held
  char* region = nullptr;
  std::vector<Chunk> crc_chunks;  // checksummed in the background if not empty
  std::vector<uint32_t> chunk_crc;
  bool crc_fused = false;            // tensor_crc came with the snapshot copy
  std::vector<uint32_t> tensor_crc;  // filled by the fused snapshot or from chunk_crc
  std::vector<uint32_t> shard_crc;   // whole-file CRCs, valid once crc_ready is set
  runtime::AsyncEvent crc_ready;
  std::vector<storage::FileImage> images;
  std::shared_ptr<SaveJob> previous;  // committed before this one
  // Owns the caller's buffers (Save's keep_alive) until nothing reads them.
  std::shared_ptr<const void> keep_alive;
  // More than staging holds: written from the caller's buffers, and Save()
  // returns only once they are written.
  bool written_before_return = false;
  runtime::AsyncEvent ended;          // set when committed or failed
  Clock::time_point snapshot_end;
  // Run once the copy is taken (Save's `check`); a failure fails the save
  // before anything is written (WriteShards).
  SnapshotCheck check;
  Status snapshot_status;
  // ---- incremental saves (Options::incremental) ----
  std::vector<Chunk> hash_chunks;          // fused CRC: the chunks hashed in the background
  std::vector<format::Hash128> chunk_hash;  // of crc_chunks, or of hash_chunks
  std::vector<format::Hash128> tensor_hash;
  std::shared_ptr<const IncrementalBase> base;  // compared against; pinned while set
  std::vector<std::optional<size_t>> reuse;     // by spec: the base tensor with the same bytes
  SavePlan changed;                  // what is written, when some tensors are reused
  std::vector<size_t> changed_from;  // changed spec -> plan spec
  bool reusing = false;
  std::shared_ptr<const IncrementalBase> committed;  // what this process wrote and holds, once built
  References references;  // the files of other checkpoints the committed step refers to
};

class ManagerImpl {
 public:
  static Result<std::unique_ptr<ManagerImpl>> Open(storage::RootUrl url, Options options, bool read_only,
                                                   std::shared_ptr<Barrier> barrier);
  ~ManagerImpl();

  Result<SaveHandle> Save(int64_t step, std::span<const TensorRef> tensors, std::string metadata_json,
                          std::shared_ptr<const void> keep_alive, std::optional<SnapshotMode> snapshot = std::nullopt,
                          SnapshotCheck check = {});
  // Blocks until every admitted save's snapshot is taken.
  void WaitSnapshots();
  Status WaitUntilFinished();
  void WaitUntilReady();
  Status RefreshNow();
  Result<RestoredCheckpoint> Restore(std::optional<int64_t> step, ProgressFn progress);
  Result<int64_t> RestoreInto(std::optional<int64_t> step, std::span<const MutableTensorRef> tensors);
  Result<int64_t> RestoreSlices(std::optional<int64_t> step, std::span<const TensorSlice> slices);
  Result<int64_t> ReadInOrder(std::optional<int64_t> step, const OrderedReader& reader, uint64_t window);
  std::vector<int64_t> AllSteps() const;
  std::optional<int64_t> LatestStep() const;
  void HoldPrefault() {
    if (staging_) staging_->HoldPrefault();
  }
  void ReleasePrefault() {
    if (staging_) staging_->ReleasePrefault();
  }
  Result<CheckpointInfo> Info(int64_t step);
  Result<VerifyReport> Verify(std::optional<int64_t> step, ProgressFn progress);
  Status Delete(int64_t step);
  Status Prune();

  const Options& options() const { return options_; }
  void set_public(CheckpointManager* p) { public_ = p; }
  void SetFinalSave(std::function<void(CheckpointManager&)> fn);
  bool preempted() const;
  const std::string& root() const { return root_; }
  ManagerStats stats() const;

  // ---- two tiers (tiers.cc) ----
  // Waits until every step queued for the remote tier is copied there (or
  // failed); returns the failures not reported yet. OK without a remote tier.
  Status WaitUntilReplicated();
  // The committed steps of both tiers, ascending (on hosts of their own:
  // of the local tier, those every host holds).
  std::vector<int64_t> AllStepsAllTiers() const;
  // Per-host roots: the committed steps of this tier that every host's
  // local tier holds, ascending.
  std::vector<int64_t> AgreedSteps() const;
  ManagerImpl* remote() const { return remote_.get(); }
  // Reads with `read(manager, step)` from the tier that holds `step`
  // (nullopt: the newest step of either tier): this one first, the remote
  // one if this one lacks the step or its copy is damaged (said on stderr).
  template <typename F>
  auto ReadFromTiers(std::optional<int64_t> step, F&& read) -> decltype(read(*this, step));

 private:
  ManagerImpl(storage::RootUrl url, Options options) : options_(std::move(options)), url_(std::move(url)), root_(url_.path) {}
  runtime::Loop& loop() { return loop_thread_->loop(); }
  std::string StepName(int64_t step) const { return options_.prefix + std::to_string(step); }
  // Ok if the manifest read from `path` (step `step`'s) says that step;
  // else the corruption error naming both. OpenStep and ReadManifest, which
  // every read of a step goes through, check it.
  static Status ManifestIsStep(const std::string& path, const format::Manifest& m, int64_t step);
  // The step a directory name is (StepName's inverse), if it is one.
  std::optional<int64_t> StepOfName(std::string_view name) const {
    const std::string& prefix = options_.prefix;
    if (name.size() <= prefix.size() || name.size() > prefix.size() + 18 || name.substr(0, prefix.size()) != prefix) {
      return std::nullopt;
    }
    int64_t step = 0;
    for (char c : name.substr(prefix.size())) {
      if (c < '0' || c > '9') return std::nullopt;
      step = step * 10 + (c - '0');
    }
    return step;
  }

  // ---- multi-host (multihost.cc) ----
  bool multihost() const { return options_.multihost.process_count > 1; }
  bool leader() const { return options_.multihost.process_index == 0; }
  // Two tiers in a multi-host job: the root is this host's own local tier
  // (hosts share no disk); the processes share the remote tier.
  bool per_host() const { return multihost() && !options_.tiers.remote.empty(); }
  // Several processes write into this root (one multi-host checkpoint).
  bool shared_root() const { return multihost() && !per_host(); }
  // This process locks the root, clears its debris and prunes it: it writes
  // the root alone, or is process 0 of those that share it.
  bool owns_root() const { return !shared_root() || leader(); }
  Status SetUpMultihost(std::shared_ptr<Barrier> barrier);
  // Waits at barrier `name` (callback barriers only; the storage fallback
  // polls instead), on the barrier thread.
  Task<Status> BarrierWait(std::string name);
  // Every process's `bytes` (by process index), once all have given theirs:
  // the barrier's AllGather, on the barrier thread; through the remote tier
  // if the barrier can only wait (ExchangeThroughRemote).
  Task<Result<std::vector<std::string>>> Exchange(std::string name, std::string bytes);
  // Each process writes its bytes into the remote tier, all wait, each reads
  // every process's, all wait again, each removes its own: 2 barriers, and
  // process_count reads per process.
  Task<Result<std::vector<std::string>>> ExchangeThroughRemote(std::string name, std::string bytes);
  // On the remote tier's manager, for ExchangeThroughRemote: writes this
  // process's part (its writer, to remove it, in *writer); reads every
  // process's; removes this one's.
  Task<Status> PutExchange(std::string name, int process, std::string bytes,
                           std::unique_ptr<storage::CheckpointWriter>* writer);
  Task<Result<std::vector<std::string>>> GetExchange(std::string name, int count);
  Task<Status> DropExchange(std::unique_ptr<storage::CheckpointWriter> writer);
  // Per-host roots: after the root is locked and cleared, the processes
  // swap what their local tiers hold (agreed_) and whether they opened.
  Task<Status> AgreeOnLocalSteps(Status opened);
  // The manifest of what this save wrote (incremental or not), validated:
  // a whole checkpoint's, or this process's part of a multi-host one.
  Result<format::Manifest> BuildManifest(SaveJob* job, format::Chunks chunks);
  Task<Status> PersistShared(SaveJob* job);
  // Per-host roots: every process writes its files and local copies into its
  // own local tier, the processes swap their parts of the manifest, and each
  // commits the merged manifest in its own tier.
  Task<Status> PersistPerHost(SaveJob* job);
  Task<Status> WriteFragment(SaveJob* job, storage::CheckpointWriter* writer, const Status& written);
  Task<Result<format::Manifest>> GatherFragments(SaveJob* job, storage::CheckpointWriter* writer);
  Task<Status> AwaitCommit(int64_t step);

  // The background failures not reported yet, as one Status (the first one's
  // code; every message, oldest first), and forgets them. REQUIRES: mu_ held.
  Status TakePendingErrors();
  // FailedPrecondition if this manager was opened read-only.
  Status CheckWritable(std::string_view what) const;
  // Re-reads the committed steps; with `remove_debris`, deletes leftovers of
  // saves that never committed.
  Task<Status> Refresh(bool remove_debris);
  // What a failed read of committed step `step` means: NotFound if the step
  // is gone now (another process pruned it meanwhile), else the failure.
  Status ExplainReadFailure(int64_t step, Status failure);
  // Resolves nullopt to the latest step and pins it against pruning.
  Result<int64_t> PinStep(std::optional<int64_t> step);
  void Unpin(int64_t step);

  Result<SaveHandle> Skip(std::shared_ptr<SaveState> state, const std::string& why);
  void TakeSnapshot(SaveJob* job);
  // TakeSnapshot, the job's check, then RunSave posted to the loop; on the
  // caller's thread or the snapshot thread.
  void SnapshotAndPost(const std::shared_ptr<SaveJob>& job, Clock::time_point snapshot_start);
  void SnapshotThread();
  Task<void> RunSave(std::shared_ptr<SaveJob> job);
  Task<Status> Persist(SaveJob* job);
  Task<Status> WriteShards(SaveJob* job, storage::CheckpointWriter* writer);
  Task<void> ComputeCrcs(SaveJob* job);
  // Each written shard's CRC32C from its tensors'; sets crc_ready.
  void FinishCrcs(SaveJob* job);
  // ---- incremental saves and references (manager_refs.cc) ----
  // Picks and pins the base, matches the tensors against it, and re-plans
  // the files to write when some are reused. Then FinishCrcs.
  Task<Status> PlanIncremental(SaveJob* job);
  // Per-host roots: the index of this host's local copies in step `step`
  // (NotFound where there is none).
  Task<Result<format::Manifest>> ReadLocalPart(int64_t step);
  // What this process wrote of step `step`: the whole manifest, or in a
  // multi-host job its own files' part (and its local copies).
  Task<Result<format::Manifest>> ReadHeldManifest(int64_t step);
  // Reads the manifest of every committed step whose references are not
  // known yet. A manifest that is gone or corrupt refers to nothing.
  Task<Status> LoadReferences();
  // The files of other checkpoints that committed steps refer to.
  References Referenced() const;
  // Removes checkpoint `name` (committed, pruned if `prune`, or debris), but
  // keeps the files `referenced` names in it, and remembers it as retired.
  Task<Status> RemoveUnreferenced(std::string name, bool prune, const References& referenced);
  // FailedPrecondition if saving `step` would replace files that kept
  // steps refer to (a retired checkpoint of that name, or with overwrite a
  // committed one).
  Task<Status> CheckNotReferenced(int64_t step);
  // Removes what retired checkpoints keep that nothing refers to any more.
  Task<Status> CollectRetired(const References& referenced);
  Task<Status> TimedWrite(storage::CheckpointWriter* writer, const storage::FileImage* image, int64_t step);
  Task<void> SetLoopTracer();
  // On the SIGTERM watcher's thread: see CheckpointManager::SetFinalSave.
  void HandleSigterm();
  // Waits (mu_ held by `lock`) until no save is in flight or the deadline.
  bool WaitIdleUntil(std::unique_lock<std::mutex>& lock, Clock::time_point deadline);
  void ReleaseStaging(SaveJob* job);
  Task<Status> PruneNow();
  // Opens committed step `step` for reading (the manifest's step checked;
  // the shards holding the tensors `filter` picks, default all). On a host of its own (a step
  // with a local-part.json), the tensors this host holds come from its
  // local tier and the others from the remote tier; with `held_only`, the
  // step is what this host holds, nothing more (tiered_read.cc).
  Task<Result<OpenedCheckpoint>> OpenStep(int64_t step, TensorFilter filter = {}, bool held_only = false);
  // Points the `wanted` tensors of `c` (a per-host step) into the remote
  // tier's files, as its manifest `remote` (null: it lacks the step) places
  // them; see OpenStep.
  Status TakeFromRemote(int64_t step, const format::Manifest* remote, OpenedCheckpoint* c,
                        std::vector<bool>* local_shard, const std::vector<size_t>& wanted);
  Task<Result<RestoredCheckpoint>> RestoreTask(int64_t step, const ProgressFn* progress);
  Task<Status> RestoreIntoTask(int64_t step, std::span<const MutableTensorRef> tensors);
  Task<Status> RestoreSlicesTask(int64_t step, std::span<const TensorSlice> slices);
  Task<Result<VerifyReport>> VerifyTask(int64_t step, const ProgressFn* progress);
  Task<Result<format::Manifest>> ReadManifest(int64_t step);
  // The manifest's bytes as committed (no parsing).
  Task<Result<std::string>> ReadManifestBytes(int64_t step);
  // ---- read_in_order.cc ----
  struct WindowRead;
  Status ReadInOrderPinned(int64_t step, const OrderedReader& reader, uint64_t window);
  std::future<Status> StartWindow(OpenedCheckpoint* ckpt, WindowRead* w);
  Task<void> RunWindow(OpenedCheckpoint* ckpt, WindowRead* w);
  Task<void> CloseCheckpoint(OpenedCheckpoint c);
  Task<Status> DeleteTask(int64_t step);
  Task<Status> LockTask();
  Task<void> CloseStorage();
  Task<Status> OpenStorage(bool create);

  Options options_;
  storage::RootUrl url_;
  std::string root_;  // url_.path: an absolute path or gs://bucket/prefix, for messages
  std::unique_ptr<runtime::CpuPool> pool_;
  std::unique_ptr<runtime::LoopThread> loop_thread_;
  std::unique_ptr<storage::Storage> storage_;  // used on the loop thread only
  std::unique_ptr<StagingPool> staging_;
  // A user's read in progress (Restore, RestoreInto, RestoreSlices,
  // ReadInOrder, Verify): the staging pre-fault waits for it, and its end
  // ends the restart hold.
  class ReadHold {
   public:
    explicit ReadHold(ManagerImpl* m) : m_(m) { m_->HoldPrefault(); }
    ~ReadHold() {
      m_->ReleasePrefault();
      m_->EndRestartHold();
    }
    ReadHold(const ReadHold&) = delete;
    ReadHold& operator=(const ReadHold&) = delete;

   private:
    ManagerImpl* m_;
  };
  // Set at Open when an explicit staging_memory would be pre-faulted in a
  // root that already holds checkpoints (a restart: it restores first): the
  // pre-fault waits until the first read ends or the first save starts, so
  // that the restore's own buffers are faulted in first.
  std::atomic<bool> restart_hold_{false};
  void EndRestartHold() {
    if (restart_hold_.exchange(false) && staging_) staging_->ReleasePrefault();
  }
  std::unique_ptr<runtime::Tracer> tracer_;  // null unless trace.path is set
  CheckpointManager* public_ = nullptr;
  std::shared_ptr<Barrier> barrier_;                 // null: the storage fallback
  std::unique_ptr<runtime::CpuPool> barrier_thread_;  // runs blocking barrier waits
  std::unique_ptr<SigtermWatcher> sigterm_;
  std::function<void(CheckpointManager&)> final_save_;  // guarded by mu_
  runtime::AsyncSemaphore prune_lock_{1};      // loop thread only

  bool read_only_ = false;

  // Snapshot "background": saves whose copy is still to take, in admission
  // order, and the thread that takes them (started by the first such save).
  std::mutex snapshot_mu_;
  std::condition_variable snapshot_cv_;  // the queue or snapshot_busy_ changed
  std::deque<std::shared_ptr<SaveJob>> snapshot_queue_;  // guarded by snapshot_mu_
  bool snapshot_busy_ = false;    // a copy is running; guarded by snapshot_mu_
  bool snapshot_stop_ = false;    // guarded by snapshot_mu_
  std::thread snapshot_thread_;

  mutable std::mutex mu_;
  std::condition_variable cv_;  // a save ended or staging was released
  std::set<int64_t> committed_;  // as of the last listing, plus our own commits
  std::set<int64_t> in_flight_steps_;
  std::multiset<int64_t> readers_;
  int in_flight_ = 0;  // admitted saves not yet ended (commit and prune)
  std::vector<Status> pending_errors_;  // background failures not yet reported, oldest first
  bool preempting_ = false;           // SIGTERM: new saves are refused...
  std::thread::id final_save_thread_;  // ...except from the final-save callback
  std::shared_ptr<SaveJob> last_job_;
  std::shared_ptr<const IncrementalBase> base_;  // the newest committed manifest (incremental)
  // Per-host roots: the steps every host's local tier committed (as of the
  // open, plus the saves since), so that every process reads the same step.
  std::set<int64_t> agreed_;  // guarded by mu_
  bool exchange_through_remote_ = false;  // loop thread only: the barrier cannot all-gather
  // Loop thread only: the references of committed steps (step -> files of
  // other checkpoints), and retired checkpoints (no manifest: pruned, but
  // holding files that kept steps refer to) -> the files they keep.
  std::map<int64_t, References> refs_;
  std::map<std::string, std::set<std::string>> retired_;

  // ---- two tiers (tiers.cc) ----
  // Opens the remote tier (read-only: to read it; else also to copy to it).
  Status OpenRemoteTier(bool read_only);
  // Queues the local steps the remote tier lacks (and, with seed_local, the
  // remote tier's newer step to copy here), and starts the copying thread.
  void StartReplicator();
  // After a local commit: queues `step` for the remote tier (pinned here
  // until copied). Drops the oldest queued step if the queue outgrows what
  // the remote tier keeps (counted in stats). REQUIRES: mu_ not held.
  void EnqueueReplication(int64_t step);
  void ReplicatorMain();
  void StopReplicator();
  // On the remote tier's manager: copies committed step `step` of the local
  // directory root `source`, whose manifest is `manifest` (its files mmapped, sent as they are; a file of
  // an earlier step the remote tier lacks is sent as one of this step's),
  // commits it manifest last, and applies the remote retention.
  // In a multi-host job each process sends its own files and leaves its
  // fragment (CommitParts); a failure to read the manifest is reported too.
  // `sent`: the earlier steps this process has sent its part of and process
  // 0 may not have committed yet: a file of theirs that is not there yet is
  // waited for (its commit), not sent again.
  Task<Status> ReplicateTask(std::string source, int64_t step, Result<std::string> manifest, std::set<int64_t> sent);
  Status Replicate(const std::string& source, int64_t step, Result<std::string> manifest, std::set<int64_t> sent);
  // On the remote tier's manager of a multi-host job: leaves this process's
  // fragment of step `whole.step` (its part `own` as sent, or the failure
  // `written`); process 0 then waits for every process's, merges them and
  // commits the step (CommitCopy). The others are done once theirs is there.
  Task<Status> CommitParts(storage::CheckpointWriter* writer, Status written, format::Manifest whole,
                           format::Manifest own, uint64_t bytes, Clock::duration took);
  // On the remote tier's manager, for a process but 0 whose part of `step`
  // is there: waits (polling, up to multihost.timeout) until process 0 has
  // committed the step, or a newer one (this one pruned or skipped since).
  Task<Status> AwaitCopyCommitted(int64_t step);
  // Leaves a fragment that says this process could not copy step `step`.
  Task<Status> ReportFailedPart(int64_t step, Status failure);
  // The oldest queued step (not one kept forever) once `queued` steps wait
  // for the remote tier and it keeps fewer: taken off the queue and counted
  // as skipped. REQUIRES: mu_ held.
  std::optional<int64_t> DropOldestQueued(size_t queued);
  // A step that will not be copied: unpinned, said once on stderr.
  void SkipReplication(int64_t step);
  // Per-host roots. Process 0, before swapping the parts of `step`: the step
  // the copies skip once `step` is queued (DropOldestQueued), off its own
  // queue at once; sent with its part. Every other process applies process
  // 0's decision (ApplyReplicationSkips), so that all hosts copy the same
  // steps.
  nlohmann::json PlanReplicationSkips(int64_t step);
  void ApplyReplicationSkips(const std::vector<int64_t>& steps);
  // tiers.seed_local, on the replicator thread: copies the remote tier's
  // committed `step` into this (local) tier, commits it manifest last. A
  // file of an earlier step this tier lacks is copied as one of this step's.
  Status SeedFromRemote(int64_t step);
  Task<Status> SeedTask(int64_t step, std::string manifest_bytes);
  // The end of either copy: commits `writer`'s checkpoint `step` (manifest
  // `m`, serialized as `manifest_bytes`) if its files were `written` OK, else
  // aborts it; then indexes it, counts its `bytes` (and a save, if
  // `count_as_save`) and applies retention.
  Task<Status> CommitCopy(storage::CheckpointWriter* writer, Status written, int64_t step, const format::Manifest& m,
                          std::string manifest_bytes, uint64_t bytes, bool count_as_save);
  // On the remote tier's manager: reads file `file` of checkpoint
  // `checkpoint`, `size` bytes, into dst (in pieces, in parallel).
  Task<Status> ReadWholeFile(std::string checkpoint, std::string file, char* dst, uint64_t size);
  std::unique_ptr<ManagerImpl> remote_;  // the remote tier, or null
  // Per-host roots: the remote tier's files, read from this tier's loop
  // (each call hops to the remote tier's), counting the bytes read.
  std::unique_ptr<storage::Storage> remote_files_;
  std::atomic<uint64_t> bytes_read_remote_{0};
  // Tensor bytes this tier's reads read (on the remote tier's manager: what
  // restores read from the remote tier).
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<bool> warned_remote_reads_{false};
  std::thread replicator_;
  std::condition_variable replication_cv_;    // the queue or replicating_ changed
  std::deque<int64_t> replication_queue_;     // guarded by mu_
  std::optional<int64_t> replicating_;        // guarded by mu_ (or seeding)
  std::optional<int64_t> seed_step_;          // guarded by mu_: to copy from the remote tier
  bool stop_replicating_ = false;             // guarded by mu_
  std::vector<Status> replication_errors_;    // guarded by mu_
  // Per-host roots, processes but 0: steps whose part this host has sent,
  // not yet seen committed in the remote tier; steps process 0 skipped.
  std::set<int64_t> awaiting_remote_commit_;  // guarded by mu_
  std::set<int64_t> skipped_remote_;          // guarded by mu_
  std::atomic<bool> warned_written_before_return_{false};
  std::atomic<bool> warned_replication_skipped_{false};
  ManagerStats stats_;
};

// The remote tier's storage `remote` (on `loop`) as a read-only storage that
// the local tier's loop can use; counts the bytes read into `bytes`.
std::unique_ptr<storage::Storage> MakeRemoteFiles(storage::Storage* remote, runtime::Loop* loop,
                                                  std::atomic<uint64_t>* bytes);

template <typename F>
auto ManagerImpl::ReadFromTiers(std::optional<int64_t> step, F&& read) -> decltype(read(*this, step)) {
  if (!remote_) return read(*this, step);
  const std::vector<int64_t> local = AllSteps(), remote = remote_->AllSteps();
  if (!step) {
    // On hosts of their own, only steps every host holds (or the remote
    // tier does): every process must read the same step.
    const std::vector<int64_t> ours = per_host() ? AgreedSteps() : local;
    if (ours.empty() && remote.empty()) return read(*this, step);  // the "no checkpoint" error
    step = std::max(ours.empty() ? -1 : ours.back(), remote.empty() ? -1 : remote.back());
  }
  const bool in_local = std::binary_search(local.begin(), local.end(), *step);
  const bool in_remote = std::binary_search(remote.begin(), remote.end(), *step);
  if (!in_local && in_remote) return read(*remote_, step);
  auto result = read(*this, step);
  Status status;
  if constexpr (std::is_same_v<decltype(result), Status>) {
    status = result;
  } else {
    status = result.status();
  }
  if (!status.ok() && status.code() == StatusCode::kCorruption && in_remote) {
    std::fprintf(stderr, "ckptio: warning: step %lld in %s is damaged (%s); reading the copy in %s\n",
                 static_cast<long long>(*step), root_.c_str(), status.message().c_str(), remote_->root().c_str());
    return read(*remote_, step);
  }
  return result;
}

}  // namespace ckptio::pipeline
