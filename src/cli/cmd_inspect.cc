// ckptio ls ROOT
// ckptio verify ROOT [--step N]

#include <algorithm>
#include <cstdio>
#include <set>
#include <string_view>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"

#include "cli/inspect.h"
#include "cli/progress.h"

namespace ckptio::cli {
namespace {

std::string Plural(size_t n, const char* word) {
  return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
}

// `step_width`: digits of the largest step, so the columns line up.
// `where`: the tiers holding the step (two tiers), else empty.
void PrintInfo(const CheckpointInfo& info, int step_width, const std::string& where) {
  // A sharded array is one tensor to its user, however many chunks it was saved in.
  std::set<std::string_view> arrays;
  size_t whole = 0, chunks = 0;
  for (const TensorInfo& t : info.tensor_list) {
    if (t.chunk.empty()) {
      ++whole;
    } else {
      ++chunks;
      arrays.insert(t.chunk.array);
    }
  }
  const size_t tensors = info.tensor_list.empty() ? info.tensors : whole + arrays.size();
  const std::string chunked = chunks == 0 ? "" : " (" + Plural(arrays.size(), "array") + " in " + Plural(chunks, "chunk") + ")";
  const std::string earlier =
      info.bytes_in_earlier == 0 ? "" : "  (" + HumanBytes(info.bytes_in_earlier) + " stored by earlier steps)";
  std::printf("step %-*lld  %-20s  %10s  %10s  %12s%s%s\n", step_width, static_cast<long long>(info.step),
              info.created.c_str(),
              HumanBytes(info.bytes).c_str(), Plural(info.shards, "shard").c_str(),
              (Plural(tensors, "tensor") + chunked).c_str(), earlier.c_str(), where.c_str());
}

// Verifies one step; prints its line or its error. `listed`: the step came
// from the root's listing, so its absence now means another process pruned
// it meanwhile, which is no failure of the checkpoints that remain.
int VerifyOne(CheckpointManager& manager, int64_t step, bool listed) {
  const Clock::time_point start = Clock::now();
  ProgressBar bar("verify step " + std::to_string(step));
  auto report = manager.Verify(step, bar.AsProgressFn());
  bar.Finish();
  if (listed && report.status().code() == StatusCode::kNotFound) {
    std::printf("step %lld: pruned while being verified (skipped)\n", static_cast<long long>(step));
    std::fflush(stdout);
    return kExitOk;
  }
  if (!report.ok()) return Report(report.status().WithContext("step " + std::to_string(step)));
  std::printf("step %lld: OK, %s in %s\n", static_cast<long long>(step), HumanBytes(report->bytes_read).c_str(),
              HumanSeconds(SecondsSince(start)).c_str());
  std::fflush(stdout);
  return kExitOk;
}

}  // namespace

int ListSteps(CheckpointManager& manager) {
  int rc = kExitOk;
  const std::vector<int64_t> steps = manager.AllSteps();
  // Two tiers: where each step is.
  const bool tiers = !manager.options().tiers.remote.empty();
  const std::vector<int64_t> local = manager.AllSteps(CheckpointManager::Tier::kLocal);
  const std::vector<int64_t> remote = manager.AllSteps(CheckpointManager::Tier::kRemote);
  if (steps.empty()) std::fprintf(stderr, "ckptio: no committed checkpoints in %s\n", manager.root().c_str());
  const int width = steps.empty() ? 1 : static_cast<int>(std::to_string(steps.back()).size());
  for (int64_t step : steps) {
    auto info = manager.Info(step);
    if (info.ok()) {
      std::string where;
      if (tiers) {
        const bool here = std::binary_search(local.begin(), local.end(), step);
        const bool there = std::binary_search(remote.begin(), remote.end(), step);
        where = here && there ? "  [local, remote]" : here ? "  [local]" : "  [remote]";
      }
      PrintInfo(*info, width, where);
    } else if (info.status().code() == StatusCode::kNotFound) {
      // Pruned by a writer since the listing: not an error of this root.
      std::fflush(stdout);
      std::fprintf(stderr, "ckptio: step %lld was pruned while being listed\n", static_cast<long long>(step));
    } else {
      rc = std::max(rc, Report(info.status().WithContext("step " + std::to_string(step))));
    }
  }
  std::fflush(stdout);
  return rc;
}

int VerifySteps(CheckpointManager& manager, std::optional<int64_t> step) {
  if (step) return VerifyOne(manager, *step, /*listed=*/false);
  const std::vector<int64_t> steps = manager.AllSteps();
  if (steps.empty()) {
    return Report(NotFoundError("no committed checkpoint in " + manager.root() + ": nothing to verify"));
  }
  int rc = kExitOk;
  for (int64_t s : steps) rc = std::max(rc, VerifyOne(manager, s, /*listed=*/true));
  return rc;
}

int RunLs(CommandArgs argv) {
  ArgParser parser("ls", "ROOT", "List the committed checkpoints of ROOT, one line per step.");
  parser.Positional("ROOT", "checkpoint root directory");
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  auto manager = OpenRootForReading(args);
  if (!manager.ok()) return Report(manager.status());
  return ListSteps(**manager);
}

int RunVerify(CommandArgs argv) {
  ArgParser parser("verify", "ROOT",
                   "Re-read every byte of every committed step (or of --step N) and check every CRC32C.\n"
                   "Exit status 2 if any step fails; 1 if there is no committed step (or no step N). A step\n"
                   "that another process prunes meanwhile is reported as pruned, not as a failure.");
  parser.Positional("ROOT", "checkpoint root directory").Flag("step", "N", "verify only step N");
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  auto step = StepFlag(args);
  if (!step.ok()) return Report(step.status());
  auto manager = OpenRootForReading(args);
  if (!manager.ok()) return Report(manager.status());
  return VerifySteps(**manager, *step);
}

}  // namespace ckptio::cli
