// ckptio export ROOT [--step N] --out FILE.safetensors
//
// Reads one step (verifying every CRC32C) and writes all its tensors as one
// safetensors file: header padded to a multiple of 8 (safetensors requires
// it), tensors contiguous in saved order, written durably via FILE.tmp.

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/files.h"
#include "cli/progress.h"
#include "cli/safetensors_io.h"

namespace ckptio::cli {
namespace {

namespace fs = std::filesystem;

constexpr size_t kHeaderAlign = 8;

// The safetensors prefix (length + header) for `tensors` laid out in order.
std::string BuildPrefix(const RestoredCheckpoint& ckpt) {
  std::vector<format::TensorEntry> entries;
  entries.reserve(ckpt.tensors.size());
  uint64_t offset = 0;
  for (const Tensor& t : ckpt.tensors) {
    entries.push_back({t.name, t.dtype, t.shape, offset, offset + t.bytes.size()});
    offset += t.bytes.size();
  }
  return format::BuildSafetensorsPrefix(entries, SafetensorsMetadata(ckpt.metadata_json), kHeaderAlign);
}

Result<RestoredCheckpoint> Read(CheckpointManager& manager, std::optional<int64_t> step) {
  ProgressBar bar(step ? "read step " + std::to_string(*step) : std::string("read latest step"));
  auto ckpt = manager.Restore(step, bar.AsProgressFn());
  bar.Finish();
  return ckpt;
}

Status Write(const RestoredCheckpoint& ckpt, const std::string& out, uint64_t* bytes) {
  const std::string prefix = BuildPrefix(ckpt);
  std::vector<std::span<const std::byte>> pieces;
  pieces.reserve(ckpt.tensors.size() + 1);
  pieces.push_back(std::as_bytes(std::span(prefix)));
  for (const Tensor& t : ckpt.tensors) pieces.emplace_back(t.bytes);
  *bytes = 0;
  for (const auto& p : pieces) *bytes += p.size();
  ProgressBar bar("write " + out);
  Status s = WriteFileAtomically(out, pieces, [&bar](uint64_t done, uint64_t total) { bar.Update(done, total); });
  bar.Finish();
  return s;
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
  ASSIGN_OR_RETURN(RestoredCheckpoint ckpt, Read(*manager, step));
  uint64_t bytes = 0;
  Status written = Write(ckpt, out, &bytes);
  if (!written.ok()) return std::move(written).WithContext("cannot export step " + std::to_string(ckpt.step));
  const double secs = SecondsSince(start);
  std::printf("exported step %lld to %s: %zu tensors, %s in %s\n", static_cast<long long>(ckpt.step), out.c_str(),
              ckpt.tensors.size(), HumanBytes(bytes).c_str(), HumanSeconds(secs).c_str());
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
