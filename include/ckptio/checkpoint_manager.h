#pragma once
// CheckpointManager: asynchronous, atomic, pruned checkpoints of a trainer's state.
//
//   auto mgr = ckptio::CheckpointManager::Open("/data/ckpt", options).value();
//   auto h = mgr->Save(step, tensors);   // returns once the snapshot is taken
//   ...train on; mutate the tensors freely (copy mode)...
//   mgr->WaitUntilFinished();            // before exit
//   auto ckpt = mgr->Restore();          // the latest committed step
//
// Save() costs the caller only the snapshot: a copy of the tensors into
// reused, pre-faulted staging memory (split across the CPU pool, CRC32C in the
// background). Writing the shards, the commit (fsync, rename, fsync of the
// parent) and pruning happen on the manager's io_uring loop thread.
// A checkpoint exists iff its manifest does; prune never touches a save in
// flight and never leaves fewer than `keep` committed checkpoints.
//
// Thread-safety: every method may be called from any thread. Saves are
// committed in the order Save() admitted them.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckptio/barrier.h"
#include "ckptio/export.h"
#include "ckptio/options.h"
#include "ckptio/status.h"
#include "ckptio/tensor.h"

namespace ckptio {

class CheckpointManager;
namespace storage {
struct RootUrl;
}  // namespace storage
namespace pipeline {
class ManagerImpl;
struct SaveState;
// Internal, not exported (src/pipeline/checkpoint_manager.cc): opens a root that the caller has
// already parsed, so that the CLI, which checks the root first, parses it once.
Result<std::unique_ptr<CheckpointManager>> OpenParsedRoot(storage::RootUrl root, Options options, bool read_only,
                                                          std::shared_ptr<Barrier> barrier);
}  // namespace pipeline

// Reports progress of a long read: bytes done so far, of total. Called on
// ckptio's loop thread; keep it quick.
using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

// Run by a save once its copy into staging is taken (snapshot "copy" and
// "background"), on the thread that took it, before anything is written: a
// failure fails the save with that status, and nothing of it is committed.
// How a caller that can tell whether its buffers changed during the copy
// (torch's version counters) refuses a torn snapshot.
using SnapshotCheck = std::function<Status()>;

struct SaveTimings {
  double snapshot_seconds = 0;  // the time Save() blocked the caller
  double persist_seconds = 0;   // from the snapshot to the durable commit
  uint64_t bytes = 0;           // bytes of the checkpoint (all shards)
};

// The caller's view of one save. Copyable; all copies share the state.
class CKPTIO_EXPORT SaveHandle {
 public:
  SaveHandle() = default;
  explicit SaveHandle(std::shared_ptr<pipeline::SaveState> state) : state_(std::move(state)) {}

  int64_t step() const;
  // True if the save was dropped because staging was full (on_busy: skip).
  bool skipped() const;
  // Returns once the snapshot is taken, when the caller may change the
  // buffers it saved: at once in "copy" mode (it was taken in Save()), once
  // the copy is done in "background" mode, once the save has ended in
  // "borrow" mode. Returns the SnapshotCheck's failure, or that of the save
  // if it ended first.
  Status WaitSnapshot() const;
  // Blocks until the save has ended; returns its final status (OK once the
  // checkpoint is committed durably; pruning older checkpoints follows).
  Status Wait() const;
  bool done() const;
  // The final status, or nullopt while the save is running.
  std::optional<Status> status() const;
  SaveTimings timings() const;
  // Bytes of the checkpoint written so far (of timings().bytes).
  uint64_t bytes_written() const;

 private:
  std::shared_ptr<pipeline::SaveState> state_;
};

struct RestoredCheckpoint {
  int64_t step = 0;
  std::string metadata_json;  // the user metadata given to Save()
  std::vector<Tensor> tensors;  // in saved order
};

// A tensor as a checkpoint's manifest describes it.
struct TensorInfo {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t bytes = 0;
  ChunkOf chunk = {};  // set when the tensor is one chunk of a larger array
};

struct CheckpointInfo {
  int64_t step = 0;
  std::string created;  // RFC 3339, UTC
  uint64_t bytes = 0;   // all shards
  uint64_t bytes_in_earlier = 0;  // of `bytes`: shards stored by earlier steps (incremental saves)
  size_t tensors = 0;
  size_t shards = 0;
  std::string metadata_json;
  std::vector<TensorInfo> tensor_list = {};  // every tensor (and chunk), in manifest order
};

struct VerifyReport {
  int64_t step = 0;
  uint64_t bytes_read = 0;
  size_t tensors = 0;
  size_t shards = 0;
};

// What CheckpointManager::ReadInOrder calls, on the calling thread: `begin`
// once, with the step, its user metadata and its tensors in saved order;
// then `piece` with consecutive byte ranges of those tensors, in that order,
// covering every byte once (a piece's bytes are valid during the call only).
// An error from either stops the read and is returned.
struct OrderedReader {
  std::function<Status(int64_t step, const std::string& metadata_json, const std::vector<TensorInfo>& tensors)> begin;
  std::function<Status(size_t tensor, uint64_t offset, std::span<const std::byte> bytes)> piece;
};

struct ManagerStats {
  uint64_t saves_committed = 0;
  uint64_t saves_failed = 0;
  uint64_t saves_skipped = 0;
  uint64_t bytes_committed = 0;   // bytes of the shard files committed saves wrote
  uint64_t bytes_reused = 0;      // tensor bytes incremental saves did not write again
  uint64_t checkpoints_pruned = 0;
  uint64_t storage_retries = 0;  // requests retried after a transient failure (GCS)
  // Two tiers: steps copied to the remote tier, copies that failed, and
  // steps never copied because newer ones were waiting (copies too slow).
  uint64_t steps_replicated = 0;
  uint64_t replications_failed = 0;
  uint64_t replications_skipped = 0;
  // Bytes of remote uploads a killed process had sent, found at the server
  // by the next one (resumed upload sessions) and not sent again.
  uint64_t bytes_resumed = 0;
  // tiers.seed_local: steps copied from the remote tier into the local one.
  uint64_t steps_seeded = 0;
  // Two tiers in a multi-host job: bytes this host's restores read from the
  // remote tier because its local tier lacked them (a replaced host, a
  // damaged local copy, another process count).
  uint64_t bytes_read_remote = 0;
  // Staging memory faulted in so far (its background pre-fault's progress).
  uint64_t staging_resident_bytes = 0;
};

class CKPTIO_EXPORT CheckpointManager {
 public:
  // Opens the checkpoint root for writing: a directory path (created if
  // needed) or a file:// URL. Takes the root's writer lock (an error names
  // the lock if another process holds it), removes the debris of saves that
  // never committed, then reserves staging memory (an explicit
  // staging_memory is pre-faulted in the background; "auto" grows with the
  // saves).
  //
  // Multi-host (options.multihost.process_count > 1): every process opens the
  // same root with its own process_index; each saves its own tensors (names
  // unique across processes) and process 0 commits them as one checkpoint.
  // `barrier` is how the processes wait for each other (null: the
  // storage-only fallback, see options.multihost.barrier). Only process 0
  // takes the lock, recovers and prunes.
  static Result<std::unique_ptr<CheckpointManager>> Open(std::string root, Options options = {},
                                                         std::shared_ptr<Barrier> barrier = nullptr);
  // Opens an existing root for reading only: no lock (a trainer may be
  // writing meanwhile), no staging memory, no clean-up. Save, Delete and
  // Prune fail with FailedPrecondition. The list of steps is read at open;
  // Refresh() reads it again.
  static Result<std::unique_ptr<CheckpointManager>> OpenReadOnly(std::string root, Options options = {});
  // Waits for every save in flight, then stops the loop.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // Snapshots `tensors` and commits them as checkpoint `step` in the
  // background. Returns after the snapshot. Errors: invalid tensors, a step
  // already committed (unless overwrite) or in flight, or the failures of
  // earlier background saves, which are returned here once (the new save is
  // then not started). `metadata_json` must be a JSON object; it is stored
  // in the manifest. A save larger than staging_memory is written straight
  // from `tensors`, and Save() returns once it is written (warned once on
  // stderr): the caller waits for the write instead of a copy.
  Result<SaveHandle> Save(int64_t step, std::span<const TensorRef> tensors,
                          std::string metadata_json = "{}");
  // As above; the manager also holds `keep_alive` (whatever owns the
  // tensors' memory) until nothing reads the tensors any more: right after
  // the snapshot copy, or, with snapshot "borrow", once the shards are
  // written (or the save failed). It is dropped on a ckptio thread. How a
  // caller whose buffers go away when unreferenced (Python's arrays, a
  // temporary contiguous copy) lends them for the length of a save.
  // `snapshot`, if set, is this save's mode instead of options.snapshot: a
  // caller that knows its buffers are immutable (jax arrays) borrows them.
  // `check`, if set, runs once the copy is taken (SnapshotCheck).
  Result<SaveHandle> Save(int64_t step, std::span<const TensorRef> tensors, std::string metadata_json,
                          std::shared_ptr<const void> keep_alive,
                          std::optional<SnapshotMode> snapshot = std::nullopt, SnapshotCheck check = {});
  // Blocks until the snapshot of every save admitted so far is taken (snapshot
  // "background"): then the caller may change any buffer it saved. Returns at
  // once in the other modes.
  void WaitSnapshots();

  // Blocks until no save is in flight (committed and pruned). Returns the
  // background failures not yet reported, if any: one Status naming every
  // failed step, with the first failure's code.
  Status WaitUntilFinished();
  // With Tier::kRemote (two tiers, Options::tiers): also until every
  // committed step bound for the remote tier is copied there, e.g. before a
  // planned shutdown, and the copy from the remote tier at open
  // (tiers.seed_local) is made; their failures too. Tier::kLocal:
  // WaitUntilFinished().
  enum class Tier { kLocal, kRemote };
  Status WaitUntilFinished(Tier tier);
  // Blocks until staging memory is resident, so the next save's snapshot
  // runs at memory speed (the first touch of fresh pages is far slower).
  // A root that held checkpoints at Open is likely restored first: there an
  // explicit staging_memory is pre-faulted from the end of the first read,
  // the first Save or this call, whichever comes first. Never call it
  // between HoldPrefault() and ReleasePrefault() on the same thread.
  void WaitUntilReady();

  // Reads checkpoint `step` (latest committed if nullopt), verifying every
  // length, offset and CRC32C.
  Result<RestoredCheckpoint> Restore(std::optional<int64_t> step = std::nullopt, ProgressFn progress = {});
  // Reads the named tensors into caller buffers (dtype and shape must match
  // the checkpoint). Returns the step read.
  Result<int64_t> RestoreInto(std::optional<int64_t> step, std::span<const MutableTensorRef> tensors);
  // Reads byte ranges of named tensors into caller buffers: what a process
  // needs when a checkpoint is restored on a different number of processes
  // than saved it. Only the shards holding them are opened; the reads are
  // ranged and run in parallel. Every tensor a slice reads from is checked
  // against its CRC32C, which covers the whole tensor: the slices of one
  // call that cover a tensor together are checked as they are, and where
  // they cover only part of it the rest is read as well (and dropped) for
  // the check. A slice of several rows (a box of a row-major array: a
  // device's columns of a chunk) has each row read straight into place, the
  // rows of all the slices of a tensor together in file order (vectored
  // reads). Returns the step read.
  Result<int64_t> RestoreSlices(std::optional<int64_t> step, std::span<const TensorSlice> slices);

  // Reads checkpoint `step` (latest committed if nullopt) from first tensor
  // to last without holding it in memory: through two buffers of `window`
  // bytes, reused (one is read while `reader` consumes the other). Every
  // length, offset and header is checked as Restore does; each tensor's
  // CRC32C is checked before its last piece is handed over, so a consumer
  // that commits its output only at the end never commits bad bytes.
  // Returns the step read. (How `ckptio export` writes a 4 GiB checkpoint as
  // one file with 128 MiB of memory.)
  Result<int64_t> ReadInOrder(std::optional<int64_t> step, const OrderedReader& reader,
                              uint64_t window = uint64_t{64} << 20);

  // Committed steps, ascending: exact for a writer; for a read-only manager,
  // as of the last listing (Open or Refresh).
  // Two tiers: the steps of both tiers (AllSteps(tier): of one of them).
  std::vector<int64_t> AllSteps() const;
  std::vector<int64_t> AllSteps(Tier tier) const;
  std::optional<int64_t> LatestStep() const;
  // Lists the root again (a reader sees commits made since).
  Status Refresh();
  Result<CheckpointInfo> Info(int64_t step);
  // Re-reads every byte of a checkpoint and checks every CRC32C and header.
  Result<VerifyReport> Verify(std::optional<int64_t> step = std::nullopt, ProgressFn progress = {});
  // Deletes a committed checkpoint (its manifest first).
  Status Delete(int64_t step);
  // Applies the keep policy now (it also runs after every commit).
  Status Prune();

  // Preemption (options.preemption.on_sigterm): when SIGTERM arrives, the
  // manager stops accepting saves, lets the saves in flight commit, then
  // calls `fn` (on a ckptio thread) which may Save() one final checkpoint,
  // all within preemption.grace; it prints what was committed to stderr and
  // then lets SIGTERM do what it would have done (the previous handler, or
  // terminate the process).
  void SetFinalSave(std::function<void(CheckpointManager&)> fn);
  // True once SIGTERM has arrived (a trainer loop may stop issuing work).
  bool preempted() const;

  const Options& options() const;
  // "/data/ckpt" or "gs://bucket/prefix".
  const std::string& root() const;
  ManagerStats stats() const;
  // A restore made of several calls (a sharded restore in batches, with the
  // caller's buffers allocated between them) holds back the background
  // pre-fault of an explicit staging_memory from the first call to the last:
  // between HoldPrefault() and ReleasePrefault() (one per hold) it starts no
  // new chunk, so that the restore's own fresh memory is faulted in first.
  // Each read call holds it by itself anyway.  A held pre-fault never
  // delays a save: a save faults in what it needs itself.
  void HoldPrefault();
  void ReleasePrefault();

 private:
  explicit CheckpointManager(std::unique_ptr<pipeline::ManagerImpl> impl);
  friend Result<std::unique_ptr<CheckpointManager>> pipeline::OpenParsedRoot(storage::RootUrl, Options, bool,
                                                                             std::shared_ptr<Barrier>);
  std::unique_ptr<pipeline::ManagerImpl> impl_;
};

}  // namespace ckptio
