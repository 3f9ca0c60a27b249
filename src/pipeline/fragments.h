#pragma once
// Fragments: each process's part of a multi-host checkpoint's manifest, and
// how process 0 gathers and merges them into the one manifest it commits.

#include <chrono>
#include <functional>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckptio/status.h"
#include "runtime/task.h"
#include "format/manifest.h"
#include "runtime/loop.h"
#include "storage/storage.h"

namespace ckptio::pipeline {

// "fragment-p00003.json"
std::string FragmentName(int process);

// The fragment of process `index` of `count` for `step`: a manifest of its
// tensors and shards (`part`), or of nothing but `error` if it failed, so
// that process 0 can say why the step was not committed. `extra` (an
// object) joins the fragment's metadata.
std::string MakeFragment(format::Manifest part, int64_t step, int index, int count, const Status& error,
                         nlohmann::json extra = nlohmann::json::object());

// Merges the fragments of every process (by process index) into the manifest
// of the step: every process's shards and tensors, in process order, the
// user's `metadata`, process 0's creation time (so that every process merging
// the same fragments gets the same bytes). Fails if a fragment says its
// process failed (Unavailable naming it), or the merged manifest is not valid.
Result<format::Manifest> MergeFragments(const std::vector<format::Manifest>& fragments, int64_t step,
                                        const std::string& step_name, nlohmann::json metadata);

struct GatherSpec {
  int count = 1;
  int64_t step = 0;
  std::string step_name;  // "checkpoint_200", for messages
  std::chrono::milliseconds timeout{0};
  // Poll until every fragment is there (the storage-only barrier), or read
  // them once (a barrier already said they are all written).
  bool poll = false;
  nlohmann::json metadata;  // the user's, for the merged manifest
  // If set: whether process p's fragment belongs to this attempt at the step
  // (else: written within the timeout). One that does not counts as missing.
  std::function<bool(int p, const format::Manifest& fragment)> accept;
  // What is waited for, in the timeout's message; default: the barrier
  // "written/<step>".
  std::string waiting_for;
};

// The storage-only barrier's polling schedule: from `first`, doubling, up to
// a cap that grows with the process count (1 s, or 2 ms per process), with
// +-25% jitter so processes do not poll in step. Every process polling
// (2,047 followers for the manifest, process 0 for the missing fragments)
// thus stays near process_count / cap requests per second: ~500/s however
// large the job, within a bucket's initial read rate.
class PollBackoff {
 public:
  PollBackoff(int process_count, std::chrono::milliseconds first);
  // The next wait, cut short at `deadline` (but at least 1 ms).
  std::chrono::milliseconds Next(std::chrono::steady_clock::time_point deadline);

 private:
  std::chrono::milliseconds next_;
  std::chrono::milliseconds cap_;
  uint64_t rng_;
};

// Reads every process's fragment (all missing ones at once, in parallel)
// and merges them, in process order, into the manifest of the step. Fails if
// a fragment says its process failed, or (polling) one is still missing at
// the timeout: DeadlineExceeded naming the processes.
Task<Result<format::Manifest>> GatherFragments(runtime::Loop& loop, storage::CheckpointWriter* writer, GatherSpec spec);

}  // namespace ckptio::pipeline
