#pragma once
// The timelines of `ckptio bench seed`: the manager's own Chrome trace
// (options.trace.path: trainer blocked in Save, snapshot, write/upload,
// CRC32C, commit, prune, io_uring batches) merged with what only the bench
// sees (the trainer's compute, each save from its start to its commit), and
// the panels of the SVG built from them.

#include <string>
#include <utility>
#include <vector>

#include "ckptio/status.h"
#include "seed/seed_experiment.h"
#include "seed/svg_timeline.h"

namespace ckptio::cli {

// Tracks of the bench's own spans (ModeResult::spans).
inline constexpr char kComputeTrack[] = "trainer: compute";
inline constexpr char kSaveCallTrack[] = "trainer: save call";
inline constexpr char kBorrowWaitTrack[] = "trainer: wait for a borrowed set";
inline constexpr char kSavesTrack[] = "saves in flight";
inline constexpr char kAuditSpanName[] = "audit CRC32C (untimed)";
inline constexpr char kAuditColor[] = "#bdbdbd";

// Reads the manager's trace (result.trace_path), adds the trainer's compute
// and the saves-in-flight spans, aligned on the Save() calls both recorded,
// writes it all to `out_path` (Chrome trace-event JSON), and returns it as a
// panel in seconds since the run started.
Result<TimelinePanel> MergeManagerTrace(const ModeResult& result, const std::string& out_path);

// What the final wait of a manager's run (WaitUntilFinished after the last
// compute) waited for, from its panel: each stage of the last save (every
// shard's write or upload, CRC32C, commit) and the prune after it, as a
// markdown table of times relative to the start of the final wait. "" if
// the run has no final wait or its last save has no spans.
std::string FinalWaitTable(const ModeResult& result, const TimelinePanel& panel, int64_t last_step);

// The naive run's panel: the trainer, and its threads' writes and prunes.
TimelinePanel NaivePanel(const ModeResult& result);

// The legend for the tracks these panels use.
std::vector<std::pair<std::string, std::string>> SeedLegend(const std::vector<TimelinePanel>& panels);

}  // namespace ckptio::cli
