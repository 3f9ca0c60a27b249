// ckptio export ROOT [--step N] --out FILE.safetensors
//
// Reads one step (verifying every CRC32C) and writes all its tensors as one
// safetensors file: header padded to a multiple of 8 (safetensors requires
// it), tensors contiguous in saved order, written durably via FILE.tmp.

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "base/status_macros.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "cli/files.h"
#include "cli/progress.h"
#include "cli/safetensors_io.h"

namespace ckptio::cli {
namespace {

namespace fs = std::filesystem;

constexpr size_t kHeaderAlign = 8;

// The safetensors prefix (length + header) of `tensors` laid out in order.
std::string BuildPrefix(const std::vector<TensorInfo>& tensors, const std::string& metadata_json) {
  std::vector<format::TensorEntry> entries;
  entries.reserve(tensors.size());
  uint64_t offset = 0;
  for (const TensorInfo& t : tensors) {
    entries.push_back({t.name, t.dtype, t.shape, offset, offset + t.bytes});
    offset += t.bytes;
  }
  return format::BuildSafetensorsPrefix(entries, SafetensorsMetadata(metadata_json), kHeaderAlign);
}

// Streams step `step` of `manager` into `out`: the checkpoint is read in
// saved order through two reused 64 MiB windows while the output is written,
// never held in memory whole. The output is renamed into place only once
// every tensor's CRC32C has been checked.
struct Exported {
  int64_t step = 0;
  size_t tensors = 0;
  uint64_t bytes = 0;
};

Result<Exported> StreamTo(CheckpointManager& manager, std::optional<int64_t> step, const std::string& out) {
  std::optional<AtomicFile> file;
  Exported done;
  uint64_t total = 0;
  ProgressBar bar("export " + (step ? "step " + std::to_string(*step) : std::string("latest step")) + " to " + out);
  OrderedReader reader;
  reader.begin = [&](int64_t s, const std::string& metadata_json, const std::vector<TensorInfo>& tensors) -> Status {
    const std::string prefix = BuildPrefix(tensors, metadata_json);
    total = prefix.size();
    for (const TensorInfo& t : tensors) total += t.bytes;
    ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::Create(out));
    file.emplace(std::move(f));
    done.step = s;
    done.tensors = tensors.size();
    return file->Append(std::as_bytes(std::span(prefix)));
  };
  reader.piece = [&](size_t, uint64_t, std::span<const std::byte> bytes) -> Status {
    RETURN_IF_ERROR(file->Append(bytes));
    bar.Update(file->size(), total);
    return Status::Ok();
  };
  Result<int64_t> read = manager.ReadInOrder(step, reader);
  bar.Finish();
  RETURN_IF_ERROR(read.status());
  done.bytes = file->size();
  Status committed = file->Commit();
  if (!committed.ok()) return std::move(committed).WithContext("cannot export step " + std::to_string(done.step));
  return done;
}

// The export must not land inside the checkpoint root: it would overwrite
// (or add to) files that ckptio owns there, such as a step's manifest.json.
Status CheckOutsideRoot(const std::string& out, const CheckpointManager& manager) {
  if (manager.root().rfind("gs://", 0) == 0) return Status::Ok();
  std::error_code ec;
  const fs::path root = fs::canonical(manager.root(), ec);
  if (ec) return Status::Ok();  // opening the root worked; reading it will say what is wrong
  fs::path parent = fs::absolute(fs::path(out), ec).parent_path();
  const fs::path resolved = fs::weakly_canonical(parent, ec);
  if (ec) return Status::Ok();  // the write names the missing directory
  auto [r, p] = std::mismatch(root.begin(), root.end(), resolved.begin(), resolved.end());
  if (r != root.end()) return Status::Ok();
  return InvalidArgumentError("--out " + fs::absolute(fs::path(out)).string() + " is inside the checkpoint root " +
                              manager.root() + ": write the export somewhere else (it would overwrite or add to "
                              "files ckptio owns)");
}

Status Export(const Args& args) {
  const std::string out = *args.Get("out");  // required: the parser checked
  ASSIGN_OR_RETURN(std::optional<int64_t> step, StepFlag(args));
  ASSIGN_OR_RETURN(auto manager, OpenRootForReading(args));
  RETURN_IF_ERROR(CheckOutsideRoot(out, *manager));
  const Clock::time_point start = Clock::now();
  ASSIGN_OR_RETURN(Exported done, StreamTo(*manager, step, out));
  const double secs = SecondsSince(start);
  std::printf("exported step %lld to %s: %zu tensors, %s in %s\n", static_cast<long long>(done.step), out.c_str(),
              done.tensors, HumanBytes(done.bytes).c_str(), HumanSeconds(secs).c_str());
  return Status::Ok();
}

}  // namespace

int RunExport(CommandArgs argv) {
  ArgParser parser("export", "ROOT",
                   "Read step N of ROOT (the latest by default), verifying every CRC32C, and write all its\n"
                   "tensors as one safetensors file FILE (via FILE.tmp, fsynced, then renamed).");
  parser.Positional("ROOT", "checkpoint root directory")
      .Flag("step", "N", "the step to export (default: the latest)")
      .Flag("out", "FILE", "the .safetensors file to write", ArgParser::Arity::kRequired);
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  return Report(Export(args));
}

}  // namespace ckptio::cli
