#pragma once
// The report of `ckptio bench seed`: the original report's table (total wall
// time, time the trainer was blocked, overhead vs pure compute, speedup),
// notes on what each mode got wrong and where ckptio's overhead goes, and
// the naive mode's per-step audit. Markdown, printed and written to
// OUT/seed_<backend>.md. Pure: no I/O.

#include <string>
#include <vector>

#include "seed/seed_experiment.h"

namespace ckptio::cli {

// What the notes say about the run's setting.
struct SeedEnvironment {
  std::string date;          // UTC, when the run started
  int cores = 0;
  std::string load_before;   // 1-minute load average
  std::string load_after;
  uint64_t state_bytes = 0;
  size_t tensors = 0;
  std::string dtypes;        // "BF16, F32, ..."
  std::string command;       // as typed
  // A warm memcpy of min(state, 1 GiB) on `copy_threads` threads, measured
  // before the runs: the floor of a copy snapshot (0: not measured).
  double copy_bytes_per_s = 0;
  unsigned copy_threads = 0;
};

// (total - compute) / compute, as a fraction.
double Overhead(const ModeResult& r);

// "total 45.2 s, trainer blocked 1.31 s": a panel's title.
std::string HumanPanelSummary(const ModeResult& r);

// The table, one row per mode.
std::string SeedTable(const std::vector<ModeResult>& results);
// Setting, definitions, correctness of each mode, ckptio's overhead.
std::string SeedNotes(const SeedConfig& config, const std::vector<ModeResult>& results, const SeedEnvironment& env);
// Each naive thread and what became of its checkpoint.
std::string NaiveStepTable(const ModeResult& naive);

}  // namespace ckptio::cli
