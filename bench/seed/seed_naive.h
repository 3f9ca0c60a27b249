#pragma once
// The naive mode of `ckptio bench seed`, private to seed_naive*.cc: a
// std::thread per save writes the trainer's live buffers as one file per
// tensor (on gs://, one object for the whole state: seed_naive_gcs.cc says
// why) into ROOT/checkpoint_<step>/, then lists the
// checkpoints and deletes all but the newest `keep`, racing the other
// threads. No snapshot, no tmp dir, no fsync, no commit point: the obvious
// fix the original report tried, reproduced with its failure modes.
//
// The harness (not the naive code) watches what goes wrong: which steps are
// still being written when a pruner deletes them, deletes of what another
// thread already deleted, writes that fail. Counters are shared by the
// threads under NaiveShared::mu.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "ckptio/options.h"
#include "ckptio/tensor.h"
#include "seed/seed_experiment.h"

namespace ckptio::cli::naive {

using Clock = std::chrono::steady_clock;

// Where the naive checkpoints go.
struct Target {
  std::string root;  // a directory, or gs://bucket/prefix
  bool gcs = false;
  // gs:// only.
  std::string bucket;
  std::string prefix;    // object name prefix of the root, no trailing '/'
  std::string endpoint;  // STORAGE_EMULATOR_HOST, gcs.endpoint or Google's
  bool emulator = false;
  Options::Gcs options;
};

Result<Target> MakeTarget(const SeedConfig& config);

// "checkpoint_300" (the manager's default prefix, so the layouts compare).
std::string StepDirName(int64_t step);
// Name of tensor i's file or object inside a checkpoint.
std::string TensorFileName(size_t i);
// The step of "checkpoint_300" (or "checkpoint_300/"), or -1.
int64_t ParseStepDirName(const std::string& name);

// One thread's life.
struct ThreadRecord {
  int64_t step = 0;
  Clock::time_point start, write_end, end;
  uint64_t bytes_written = 0;
  int write_errors = 0;
  int pruned = 0;  // checkpoints this thread deleted
};

// What the threads of one run share.
class Shared {
 public:
  Shared(const SeedConfig& config, Target target, std::span<const TensorRef> tensors)
      : config_(config), target_(std::move(target)), tensors_(tensors.begin(), tensors.end()) {}

  const SeedConfig& config() const { return config_; }
  const Target& target() const { return target_; }
  const std::vector<TensorRef>& tensors() const { return tensors_; }

  void BeginWriting(int64_t step);
  void EndWriting(int64_t step);
  bool Writing(int64_t step) const;

  enum class PruneOutcome { kOk, kAlreadyGone, kOther };
  // Counts one deleted (or not) checkpoint; `in_flight` if its thread was
  // still writing it when the delete began.
  void CountPrune(PruneOutcome outcome, bool in_flight, const std::string& what);
  void CountWriteError(const std::string& what);
  NaiveErrors errors() const;

 private:
  void NoteError(const std::string& what);  // REQUIRES: mu_ held

  const SeedConfig& config_;
  const Target target_;
  const std::vector<TensorRef> tensors_;
  mutable std::mutex mu_;
  std::set<int64_t> writing_;  // guarded by mu_
  NaiveErrors errors_;         // guarded by mu_
};

// A naive thread's body: write the checkpoint, then prune.
void RunLocalThread(Shared* shared, ThreadRecord* record);
void RunGcsThread(Shared* shared, ThreadRecord* record);

// Audits and removal of what naive runs wrote (seed_naive_gcs.cc for gs://).
AuditResult AuditGcs(const SeedConfig& config, const Target& target, std::span<const TensorRef> tensors,
                     const ExpectedCrcs& expected);
Status CleanupGcs(const Target& target);

}  // namespace ckptio::cli::naive
