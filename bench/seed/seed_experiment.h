#pragma once
// `ckptio bench seed`: the experiment that started the project, at this
// machine's scale. A simulated trainer (cli/demo_state.h) computes for
// `compute` seconds, then saves its state, `saves` times, keeping 3, in three
// modes:
//
//   blocking  ckptio Save() then Wait(): the trainer waits for the whole write
//             and commit (what flax's save_checkpoint does).
//   naive     a std::thread per save that writes the trainer's live buffers
//             (no snapshot, no tmp dir, no fsync) and then prunes all but the
//             newest `keep` checkpoints, racing the other threads like the
//             original did; joined at the end.
//   ckptio    Save() returns after the snapshot; WaitUntilFinished() at the
//             end, inside the total.
//   ckptio-borrow
//             a JAX-like trainer: a step writes a new state and never
//             mutates the old one. The state is double-buffered
//             (DemoState with two sets); Save() borrows the set the last
//             compute wrote (snapshot "borrow": no copy, staging holds only
//             the shard headers), and the trainer waits for that save before
//             the compute after next overwrites the set (counted as blocked).
//
// Every mode is then audited against the state as of each save (per-tensor
// CRC32C taken on the trainer thread right before the save, outside the
// timed totals): which checkpoints exist, are complete, are bit-exact.
//
// Threads: the caller's thread is the trainer; naive mode adds its threads.

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ckptio/options.h"
#include "ckptio/status.h"
#include "ckptio/tensor.h"
#include "seed/svg_timeline.h"

namespace ckptio::cli {

class DemoState;

enum class SeedMode { kBlocking, kNaive, kCkptio, kCkptioBorrow };
const char* SeedModeName(SeedMode mode);
// The modes that run a CheckpointManager without waiting for each save.
bool IsCkptioMode(SeedMode mode);

struct SeedConfig {
  uint64_t state_size = uint64_t{1} << 30;
  int saves = 20;
  std::chrono::nanoseconds compute = std::chrono::seconds(2);
  // A directory or gs://bucket/prefix; mode M writes under DEST/M.
  std::string dest = "./ckptio-seed";
  int keep = 3;
  std::vector<SeedMode> modes = {SeedMode::kBlocking, SeedMode::kNaive, SeedMode::kCkptio, SeedMode::kCkptioBorrow};
  std::string out_dir = "bench/results";
  bool audit = true;    // per-save CRC32C of the state, checked against what was kept
  bool cleanup = false;  // delete each mode's checkpoints once audited
  // Free text for the report: how the run was set up (the proxy's shaping...).
  std::string note;
  Options options;  // the manager's (blocking and ckptio modes), keep included
  // staging_memory of the ckptio-borrow run: it stages only shard headers
  // (cmd_bench.cc sizes it from the shard plan).
  uint64_t borrow_staging_memory = uint64_t{1} << 20;

  bool gcs() const { return dest.rfind("gs://", 0) == 0; }
  // "gcs" or "local": names the output files.
  std::string backend() const { return gcs() ? "gcs" : "local"; }
  std::string ModeRoot(SeedMode mode) const;
};

// A span on one named track, in seconds since the timed run started.
using TimedSpan = TimelineSpan;

// One checkpoint as the audit found it at the end of a run.
struct StepAudit {
  int64_t step = 0;
  bool expected = false;  // among the newest `keep` saves
  bool present = false;   // anything of it exists
  bool complete = false;  // every tensor, right sizes
  int tensors_present = 0;
  int tensors_torn = 0;   // bytes differ from the state at save time
  bool checked = false;   // its bytes were compared (audit on, complete)
};

struct AuditResult {
  int tensors = 0;  // per checkpoint
  std::vector<StepAudit> steps;  // every step saved, ascending
  int expected = 0;
  int good = 0;        // expected, complete, bit-exact (or unchecked with audit off)
  int missing = 0;     // expected, absent
  int incomplete = 0;  // present, files/objects missing or of the wrong size
  int torn = 0;        // complete, but some tensor's bytes differ
  int leaked = 0;      // present though it should have been pruned
  std::string error;   // the audit itself failed
};

// What went wrong inside the naive threads (counted as it happened).
struct NaiveErrors {
  int write_errors = 0;        // a file/object that could not be written
  int prune_already_gone = 0;  // delete of something another thread deleted
  int prune_in_flight = 0;     // deleted a checkpoint whose thread was still writing
  int prune_other = 0;         // any other failed delete or listing
  int max_concurrent = 0;      // threads writing at once, at most
  std::string first_error;
};

// One naive thread, as it went.
struct NaiveThreadSummary {
  int64_t step = 0;
  double write_seconds = 0;
  double prune_seconds = 0;
  int write_errors = 0;
  int pruned = 0;  // checkpoints it deleted
};

struct ModeResult {
  SeedMode mode = SeedMode::kBlocking;
  double total = 0;        // wall time of the run, final wait included, audit pauses excluded
  double compute = 0;      // wall time in Compute()
  double compute_cpu = 0;  // the trainer thread's CPU time in Compute()
  double blocked = 0;      // sum over saves of the time the save calls held the trainer, borrow_wait included
  double borrow_wait = 0;  // ckptio-borrow: waiting for the save that borrowed the set the next compute writes
  int borrow_waits = 0;    // how many of those waits found the save still running
  double final_wait = 0;   // WaitUntilFinished / join at the end
  double audit_paused = 0;  // time of the per-save CRC32C, left out of total
  double wall = 0;         // raw wall time of the run, audit pauses included (timelines)
  double persisting = 0;   // union of [save started, durable] intervals
  uint64_t bytes = 0;      // bytes of all saves written
  std::vector<double> save_seconds;  // per save: what it blocked the trainer
  int max_in_flight = 0;   // saves in the background at once, at most
  AuditResult audit;
  NaiveErrors naive;
  std::vector<NaiveThreadSummary> threads;  // naive mode
  std::vector<TimedSpan> spans;  // the bench's own: compute, saves, naive threads
  std::string trace_path;        // the manager's Chrome trace (blocking, ckptio), "" if none
  uint64_t state_memory = 0;     // bytes of trainer state (2 sets in ckptio-borrow)
  uint64_t staging_memory = 0;   // the manager's staging_memory (0: naive)
  std::string error;             // the run failed; the rest is partial
};

// What a mode does at each save, and at the end. Save() is timed as the
// trainer's blocked time.
class SeedSaver {
 public:
  virtual ~SeedSaver() = default;
  virtual Status Save(int64_t step, std::span<const TensorRef> tensors) = 0;
  // Blocks until no save of this mode still reads `tensors` (the buffers the
  // next compute is about to overwrite); returns whether it had to wait.
  // Only a borrowing mode ever waits: the others copy, or (naive) race.
  virtual Result<bool> ReleaseBuffers(std::span<const TensorRef> tensors) {
    (void)tensors;
    return false;
  }
  // Blocks until every save has ended (timed as the final wait).
  virtual Status Finish() = 0;
  // After Finish: fills bytes, persisting, max_in_flight, naive errors and
  // spans (times relative to `start`, the run's time zero), and releases
  // what the mode holds (a manager writes its trace file as it closes).
  virtual void Collect(std::chrono::steady_clock::time_point start, ModeResult* result) = 0;
};

// The modes (seed_modes.cc, seed_naive.cc), opened, cleared of an earlier
// run's checkpoints and warmed up: ready for the timed run.
Result<std::unique_ptr<SeedSaver>> MakeManagerSaver(const SeedConfig& config, SeedMode mode,
                                                    std::span<const TensorRef> tensors, const std::string& trace_path);
Result<std::unique_ptr<SeedSaver>> MakeNaiveSaver(const SeedConfig& config, std::span<const TensorRef> tensors);

// Expected per-tensor CRC32C by step (empty with audit off).
using ExpectedCrcs = std::map<int64_t, std::vector<uint32_t>>;

// Audits what a run left (seed_modes.cc, seed_naive.cc, seed_naive_gcs.cc).
AuditResult AuditManagerRoot(const SeedConfig& config, SeedMode mode, std::span<const TensorRef> tensors,
                             const ExpectedCrcs& expected);
AuditResult AuditNaiveRoot(const SeedConfig& config, std::span<const TensorRef> tensors,
                           const ExpectedCrcs& expected);
// Fills the counts of `audit` from its steps.
void SummarizeAudit(AuditResult* audit);
// Deletes what a mode wrote under its root (--cleanup).
Status CleanupManagerRoot(const SeedConfig& config, SeedMode mode);
Status CleanupNaiveRoot(const SeedConfig& config);

// Runs one mode on `state` (which carries on from where the previous mode
// left it; ckptio-borrow needs a state of two sets): opens and warms it up,
// runs the timed trainer loop, audits what it left and (--cleanup) deletes
// it. The manager's trace goes to `trace_path` (every mode but naive). An
// error of the run itself is in
// ModeResult::error; a failure to even start is the error result.
Result<ModeResult> RunSeedMode(const SeedConfig& config, SeedMode mode, DemoState* state,
                               const std::string& trace_path);

// The steps of a run: 100, 200, ... (like a trainer saving every 100 steps).
int64_t SeedStep(int i);
// The steps a keep-K policy leaves after `saves` saves.
bool ExpectedKept(const SeedConfig& config, int64_t step);

}  // namespace ckptio::cli
