// ckptio rm ROOT --step N
// ckptio prune ROOT --keep K

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <limits>
#include <vector>

#include "base/status_macros.h"
#include "cli/commands.h"
#include "cli/common.h"

namespace ckptio::cli {
namespace {

Status Rm(const Args& args) {
  ASSIGN_OR_RETURN(std::optional<int64_t> step, StepFlag(args));  // required: set
  ASSIGN_OR_RETURN(Options options, LoadOptions(args));
  // A writer (it takes the root's lock), with the small staging of a reader.
  ASSIGN_OR_RETURN(auto manager, OpenExistingRoot(args.positional(0), ReadOnlyOptions(options), /*read_only=*/false));
  RETURN_IF_ERROR(manager->Delete(*step));
  std::printf("deleted step %lld\n", static_cast<long long>(*step));
  return Status::Ok();
}

Status Prune(const Args& args) {
  ASSIGN_OR_RETURN(std::optional<int64_t> keep, args.GetInt("keep", 0, std::numeric_limits<int>::max()));
  ASSIGN_OR_RETURN(Options options, LoadOptions(args));
  options = ReadOnlyOptions(options);
  options.keep = static_cast<int>(*keep);
  ASSIGN_OR_RETURN(auto manager, OpenExistingRoot(args.positional(0), options, /*read_only=*/false));
  const std::vector<int64_t> before = manager->AllSteps();
  Status pruned = manager->Prune();
  // What is gone is reported even if a later deletion failed.
  const std::vector<int64_t> after = manager->AllSteps();
  std::vector<int64_t> gone;
  std::set_difference(before.begin(), before.end(), after.begin(), after.end(), std::back_inserter(gone));
  for (int64_t step : gone) std::printf("deleted step %lld\n", static_cast<long long>(step));
  if (gone.empty() && pruned.ok()) {
    std::printf("nothing to prune: %zu checkpoint%s, keep %d\n", before.size(), before.size() == 1 ? "" : "s",
                options.keep);
  }
  return pruned;
}

}  // namespace

int RunRm(CommandArgs argv) {
  ArgParser parser("rm", "ROOT", "Delete the committed checkpoint of step N (its manifest first).");
  parser.Positional("ROOT", "checkpoint root directory")
      .Flag("step", "N", "the step to delete", ArgParser::Arity::kRequired);
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  return Report(Rm(args));
}

int RunPrune(CommandArgs argv) {
  ArgParser parser("prune", "ROOT",
                   "Delete all but the newest K committed checkpoints (keep_every from the config still\n"
                   "protects every keep_every-th step).");
  parser.Positional("ROOT", "checkpoint root directory")
      .Flag("keep", "K", "checkpoints to keep (0 keeps all)", ArgParser::Arity::kRequired);
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  return Report(Prune(args));
}

}  // namespace ckptio::cli
