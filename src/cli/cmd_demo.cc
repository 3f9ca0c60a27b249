// ckptio demo [--state-size SIZE] [--saves N] [--compute DURATION] [--dir DIR] [--keep K]
//
// A simulated trainer saving its state every `compute` seconds, run twice:
// with blocking saves (Save, then Wait for the commit, as flax's
// save_checkpoint does) into DIR/blocking, then with ckptio's asynchronous
// saves (Save returns after the snapshot) into DIR/async. Prints what each
// cost the trainer, then `ls` and `verify` of DIR/async.

#include <algorithm>
#include <cstdio>
#include <limits>
#include <utility>
#include <vector>

#include "base/status_macros.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/demo_state.h"
#include "cli/inspect.h"
#include "cli/trainer_sim.h"

namespace ckptio::cli {
namespace {

using std::chrono::nanoseconds;

enum class Mode { kBlocking, kAsync };

struct DemoArgs {
  uint64_t state_size = uint64_t{1} << 30;
  int saves = 10;
  nanoseconds compute = std::chrono::seconds(1);
  std::string dir = "./ckptio-demo";
  Options options;  // the manager's, as the config and the flags make them
};

struct RunStats {
  double total = 0;      // wall time of the whole run, final wait included
  double compute = 0;    // time in Compute()
  double blocked = 0;    // time the trainer spent in Save/Wait
  double persisting = 0;  // union of the saves' [start, durable] intervals
  uint64_t bytes = 0;    // of all committed saves
  int skipped = 0;       // on_busy: skip
};

const char* ModeName(Mode m) { return m == Mode::kBlocking ? "blocking" : "async"; }

std::string StepMetadata(Mode mode, int64_t step) {
  return std::string("{\"demo\":\"") + ModeName(mode) + "\",\"step\":" + std::to_string(step) + "}";
}


// Collects the outcome of every save once the run has ended.
Status Tally(const std::vector<std::pair<Clock::time_point, SaveHandle>>& saves, Clock::time_point start,
             RunStats* stats) {
  std::vector<std::pair<double, double>> intervals;
  for (const auto& [begin, handle] : saves) {
    if (handle.skipped()) {
      ++stats->skipped;
      continue;
    }
    RETURN_IF_ERROR(handle.Wait());
    const SaveTimings t = handle.timings();
    const double s = std::chrono::duration<double>(begin - start).count();
    intervals.emplace_back(s, s + t.snapshot_seconds + t.persist_seconds);
    stats->bytes += t.bytes;
  }
  stats->persisting = UnionLength(std::move(intervals));
  return Status::Ok();
}

Result<RunStats> RunTrainer(Mode mode, const DemoArgs& a, DemoState* state, const std::string& dir) {
  ASSIGN_OR_RETURN(auto manager, CheckpointManager::Open(dir, a.options));
  // What an earlier demo run left in `dir` goes, so steps start fresh; then
  // untimed warm-up saves (trainer_sim.h says why).
  ASSIGN_OR_RETURN(size_t removed, ClearCheckpoints(*manager));
  if (removed > 0) {
    std::printf("  (removed %zu checkpoints of an earlier run from %s)\n", removed, manager->root().c_str());
  }
  RETURN_IF_ERROR(WarmUp(*manager, state->tensors()));
  RunStats stats;
  std::vector<std::pair<Clock::time_point, SaveHandle>> saves;
  const Clock::time_point start = Clock::now();
  for (int i = 1; i <= a.saves; ++i) {
    const Clock::time_point c0 = Clock::now();
    state->Compute(a.compute);
    stats.compute += SecondsSince(c0);
    const int64_t step = int64_t{100} * i;
    const Clock::time_point s0 = Clock::now();
    ASSIGN_OR_RETURN(SaveHandle h, manager->Save(step, state->tensors(), StepMetadata(mode, step)));
    if (mode == Mode::kBlocking && !h.skipped()) RETURN_IF_ERROR(h.Wait());
    stats.blocked += SecondsSince(s0);
    saves.emplace_back(s0, std::move(h));
  }
  const Clock::time_point w0 = Clock::now();
  RETURN_IF_ERROR(manager->WaitUntilFinished());
  stats.blocked += SecondsSince(w0);
  stats.total = SecondsSince(start);
  RETURN_IF_ERROR(Tally(saves, start, &stats));
  return stats;
}

void PrintRow(const char* name, const RunStats& r, double baseline_total) {
  std::printf("%-10s %9s %9s %18s %10.1f%% %20s %8.2fx\n", name, HumanSeconds(r.total).c_str(),
              HumanSeconds(r.compute).c_str(), HumanSeconds(r.blocked).c_str(),
              r.compute > 0 ? 100.0 * (r.total - r.compute) / r.compute : 0.0,
              HumanRate(r.bytes, r.persisting).c_str(), r.total > 0 ? baseline_total / r.total : 0.0);
}

void PrintTable(const RunStats& blocking, const RunStats& async) {
  std::printf("\n%-10s %9s %9s %18s %11s %20s %9s\n", "", "total", "compute", "blocked in saves", "overhead",
              "checkpoint bytes/s", "speedup");
  PrintRow("blocking", blocking, blocking.total);
  PrintRow("ckptio", async, blocking.total);
  for (const RunStats* r : {&blocking, &async}) {
    if (r->skipped > 0) std::printf("(%s: %d saves skipped, on_busy: skip)\n", r == &blocking ? "blocking" : "ckptio", r->skipped);
  }
  std::printf(
      "\noverhead: (total - compute) / compute. checkpoint bytes/s: bytes of all saves / time during which\n"
      "a save was being persisted (from Save() to the durable commit). speedup: blocking total / total.\n");
}

Result<DemoArgs> ParseDemoArgs(const Args& args) {
  DemoArgs a;
  ASSIGN_OR_RETURN(a.options, LoadOptions(args));
  ASSIGN_OR_RETURN(std::optional<uint64_t> size, args.GetSize("state-size"));
  ASSIGN_OR_RETURN(std::optional<int64_t> saves, args.GetInt("saves", 1, 1'000'000));
  ASSIGN_OR_RETURN(std::optional<nanoseconds> compute, args.GetDuration("compute"));
  ASSIGN_OR_RETURN(std::optional<int64_t> keep, args.GetInt("keep", 0, std::numeric_limits<int>::max()));
  a.state_size = size.value_or(a.state_size);
  a.saves = static_cast<int>(saves.value_or(a.saves));
  a.compute = compute.value_or(a.compute);
  a.dir = args.Get("dir").value_or(a.dir);
  if (keep) a.options.keep = static_cast<int>(*keep);
  // Two saves' worth, so one can be written while the next is snapshotted,
  // unless the config chose a size (the field has no "unset" state: a config
  // that sets exactly the default is treated as not setting it).
  if (a.options.staging_memory == Options{}.staging_memory) a.options.staging_memory = 2 * a.state_size;
  // The trainer mutates its state right after Save() returns.
  a.options.snapshot = SnapshotMode::kCopy;
  return a;
}

Status Demo(const DemoArgs& a) {
  ASSIGN_OR_RETURN(DemoState state, DemoState::Create(a.state_size));
  std::printf("ckptio demo: state %s in %zu tensors (%s); %d saves, %s of compute between saves\n",
              HumanBytes(state.bytes()).c_str(), state.tensors().size(), state.DTypeSummary().c_str(), a.saves,
              HumanSeconds(std::chrono::duration<double>(a.compute).count()).c_str());
  std::printf("staging %s, keep %d, shards of %s; each run starts with 2 untimed warm-up saves (deleted)\n",
              HumanBytes(a.options.staging_memory).c_str(), a.options.keep, HumanBytes(a.options.shard_size).c_str());
  RunStats runs[2];
  for (Mode mode : {Mode::kBlocking, Mode::kAsync}) {
    const std::string dir = a.dir + "/" + ModeName(mode);
    std::printf("%s saves into %s ...\n", ModeName(mode), dir.c_str());
    std::fflush(stdout);
    auto r = RunTrainer(mode, a, &state, dir);
    if (!r.ok()) return r.status().WithContext(std::string(ModeName(mode)) + " run");
    runs[mode == Mode::kBlocking ? 0 : 1] = *r;
  }
  PrintTable(runs[0], runs[1]);
  return Status::Ok();
}

// `ls` and `verify` of DIR/async, as a user would run them.
int ShowResult(const DemoArgs& a) {
  const std::string root = a.dir + "/async";
  auto manager = OpenExistingRoot(root, ReadOnlyOptions(a.options), /*read_only=*/true);
  if (!manager.ok()) return Report(manager.status());
  std::printf("\n$ ckptio ls %s\n", root.c_str());
  std::fflush(stdout);
  int rc = ListSteps(**manager);
  std::printf("\n$ ckptio verify %s\n", root.c_str());
  std::fflush(stdout);
  return std::max(rc, VerifySteps(**manager, std::nullopt));
}

}  // namespace

int RunDemo(CommandArgs argv) {
  ArgParser parser("demo", "",
                   "Simulate a trainer that saves its state every --compute seconds, first with blocking\n"
                   "saves (Save then Wait) into DIR/blocking, then with ckptio's async saves into DIR/async;\n"
                   "print what the saves cost the trainer, then `ls` and `verify` of DIR/async. Checkpoints\n"
                   "of an earlier demo run in those directories are deleted first.");
  parser.Flag("state-size", "SIZE", "bytes of trainer state, e.g. 256MiB (default 1GiB)")
      .Flag("saves", "N", "saves per run (default 10)")
      .Flag("compute", "DURATION", "busy work between saves, e.g. 500ms (default 1s)")
      .Flag("dir", "DIR", "where the two runs write (default ./ckptio-demo)")
      .Flag("keep", "K", "checkpoints to keep (default: the config's keep, 3)");
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  auto a = ParseDemoArgs(args);
  if (!a.ok()) return Report(a.status());
  if (Status s = Demo(*a); !s.ok()) return Report(s);
  return ShowResult(*a);
}

}  // namespace ckptio::cli
