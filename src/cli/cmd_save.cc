// ckptio save ROOT --step N --from A.safetensors [--from B.safetensors ...] [--metadata JSON]
//
// Commits existing safetensors files as one checkpoint, without copying them
// into staging: the inputs are mapped read-only and saved with snapshot
// "borrow" (the mappings stay valid until the save has ended).

#include <chrono>
#include <cstdio>
#include <limits>
#include <map>
#include <thread>
#include <vector>

#include "base/status_macros.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/progress.h"
#include "cli/safetensors_io.h"

namespace ckptio::cli {
namespace {

constexpr auto kPollInterval = std::chrono::milliseconds(10);

struct Inputs {
  std::vector<SafetensorsInput> files;
  std::vector<TensorRef> tensors;  // pointing into files' mappings
  std::map<std::string, std::string> metadata;  // merged "__metadata__"
  uint64_t header_bytes = 0;
  uint64_t data_bytes = 0;
};

// Adds one input's tensors and metadata, refusing a name that an earlier
// input already holds (a checkpoint's names are unique). With
// `merge_metadata` false (--metadata given), the inputs' __metadata__ is not
// merged, so it may differ between them.
Status AddInput(SafetensorsInput input, Inputs* in, std::map<std::string, std::string>* owner, bool merge_metadata) {
  const std::string& path = input.file.path();
  for (TensorRef& t : TensorRefsOf(input)) {
    auto [it, inserted] = owner->emplace(t.name, path);
    if (!inserted) {
      return InvalidArgumentError("tensor \"" + t.name + "\" is in both " + it->second + " and " + path +
                                  ": tensor names must be unique across the --from files");
    }
    in->tensors.push_back(std::move(t));
  }
  for (const auto& [key, value] : input.header.metadata) {
    if (!merge_metadata) break;
    auto [it, inserted] = in->metadata.emplace(key, value);
    if (!inserted && it->second != value) {
      return InvalidArgumentError("__metadata__ key \"" + key + "\" differs between the --from files (" + path +
                                  " says \"" + value + "\"): pass --metadata to choose");
    }
  }
  in->header_bytes += input.header.data_start;
  in->data_bytes += input.file.bytes().size() - input.header.data_start;
  in->files.push_back(std::move(input));
  return Status::Ok();
}

Result<Inputs> OpenInputs(const std::vector<std::string>& paths, bool merge_metadata) {
  Inputs in;
  std::map<std::string, std::string> owner;  // tensor name -> file
  for (const std::string& path : paths) {
    ASSIGN_OR_RETURN(SafetensorsInput input, OpenSafetensors(path));
    RETURN_IF_ERROR(AddInput(std::move(input), &in, &owner, merge_metadata));
  }
  return in;
}

// Borrow mode stages only the shard prefixes (headers padded to 4 KiB): a
// bound on their size, generous so a header-heavy input still fits.
uint64_t PrefixStaging(const Inputs& in, const Options& options) {
  const uint64_t shards = in.tensors.size() + in.data_bytes / std::max<uint64_t>(options.shard_size, 1) + 2;
  return (uint64_t{16} << 20) + 2 * in.header_bytes + shards * 8192;
}

// Waits for the save, drawing the bytes written on a terminal.
Status WaitWithProgress(const SaveHandle& handle) {
  ProgressBar bar("save step " + std::to_string(handle.step()));
  if (!bar.enabled()) return handle.Wait();
  const uint64_t total = handle.timings().bytes;
  while (!handle.done()) {
    bar.Update(handle.bytes_written(), total);
    std::this_thread::sleep_for(kPollInterval);
  }
  bar.Finish();
  return handle.Wait();
}

Status Save(const Args& args) {
  ASSIGN_OR_RETURN(std::optional<int64_t> step, StepFlag(args));
  ASSIGN_OR_RETURN(Options options, LoadOptions(args));
  const std::optional<std::string> given_metadata = args.Get("metadata");
  ASSIGN_OR_RETURN(Inputs in, OpenInputs(args.GetAll("from"), /*merge_metadata=*/!given_metadata));
  std::string metadata = given_metadata.value_or(MetadataJson(in.metadata));
  options.snapshot = SnapshotMode::kBorrow;
  options.staging_memory = PrefixStaging(in, options);
  options.io.register_buffers = false;
  // An import must not delete the root's other checkpoints as a side effect
  // of the trainer's keep policy; `ckptio prune` does that on request.
  options.keep = 0;
  options.tiers.remote_keep = 0;
  ASSIGN_OR_RETURN(auto manager, CheckpointManager::Open(args.positional(0), options));
  const Clock::time_point start = Clock::now();
  ASSIGN_OR_RETURN(SaveHandle handle, manager->Save(*step, in.tensors, std::move(metadata)));
  RETURN_IF_ERROR(WaitWithProgress(handle));
  const double secs = SecondsSince(start);
  const uint64_t bytes = handle.timings().bytes;
  std::printf("saved step %lld to %s: %zu tensors from %zu files, %s in %s (%s)\n", static_cast<long long>(*step),
              manager->root().c_str(), in.tensors.size(), in.files.size(), HumanBytes(bytes).c_str(),
              HumanSeconds(secs).c_str(), HumanRate(bytes, secs).c_str());
  if (!options.tiers.remote.empty()) {
    // A command ends with its work done: the copy to the remote tier too.
    std::printf("copying step %lld to the remote tier %s\n", static_cast<long long>(*step),
                options.tiers.remote.c_str());
    std::fflush(stdout);
    RETURN_IF_ERROR(manager->WaitUntilFinished(CheckpointManager::Tier::kRemote));
  }
  if (uint64_t retries = manager->stats().storage_retries) {
    std::printf("%llu request%s retried after transient failures\n", static_cast<unsigned long long>(retries),
                retries == 1 ? "" : "s");
  }
  return Status::Ok();
}

}  // namespace

int RunSave(CommandArgs argv) {
  ArgParser parser("save", "ROOT",
                   "Commit existing safetensors files as checkpoint N of ROOT (created if needed). The\n"
                   "files are mapped read-only and written without a copy; tensor names must be unique\n"
                   "across them. Without --metadata, the files' __metadata__ becomes the checkpoint's.\n"
                   "Never prunes other checkpoints (see: ckptio prune). With two tiers (config \"tiers\"), returns\n"
                   "once the step is copied to the remote tier too.");
  parser.Positional("ROOT", "checkpoint root directory")
      .Flag("step", "N", "the step to commit", ArgParser::Arity::kRequired)
      .Flag("from", "FILE", "a .safetensors input", ArgParser::Arity::kOneOrMore)
      .Flag("metadata", "JSON", "user metadata to store in the manifest, a JSON object");
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  return Report(Save(args));
}

}  // namespace ckptio::cli
