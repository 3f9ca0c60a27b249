// ckptio export ROOT [--step N] --out FILE.safetensors
//
// Reads one step (verifying every CRC32C) and writes all its tensors as one
// safetensors file: header padded to a multiple of 8 (safetensors requires
// it), tensors contiguous in saved order, written durably via FILE.tmp. An
// array saved in chunks (a sharded jax.Array) is written as one tensor of its
// global shape.

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
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

// Where the export puts the checkpoint's tensors: whole tensors as they are,
// and each array saved in chunks (a sharded jax.Array) as one tensor of its
// global shape, placed where its first chunk comes in saved order. Each chunk
// is then written into its box of that tensor: runs of contiguous bytes, one
// per index of the axes before the first one from which the chunk spans the
// whole array.
class Layout {
 public:
  Layout(const std::vector<TensorInfo>& tensors, const std::string& metadata_json) {
    std::map<std::string, size_t> arrays;  // array name -> index in entries_
    for (const TensorInfo& t : tensors) {
      Place place;
      if (t.chunk.empty()) {
        place.entry = Add(t.name, t.dtype, t.shape, t.bytes);
      } else {
        auto [it, added] = arrays.try_emplace(t.chunk.array, entries_.size());
        // The reader checked the global shape's bytes against the limit.
        if (added) Add(t.chunk.array, t.dtype, t.chunk.global_shape, *base::TensorBytes(t.dtype, t.chunk.global_shape));
        place.entry = it->second;
        place.chunk = &t;
        chunked_ = true;
      }
      places_.push_back(place);
    }
    prefix_ = format::BuildSafetensorsPrefix(entries_, SafetensorsMetadata(metadata_json), kHeaderAlign);
  }

  bool chunked() const { return chunked_; }
  size_t tensors() const { return entries_.size(); }  // of the export (an array counts once)
  const std::string& prefix() const { return prefix_; }
  uint64_t size() const { return prefix_.size() + data_bytes_; }

  // Writes bytes [offset, offset + size) of input tensor `tensor` where they go.
  Status Write(AtomicFile& file, size_t tensor, uint64_t offset, std::span<const std::byte> bytes) const {
    const Place& p = places_[tensor];
    const uint64_t base = prefix_.size() + entries_[p.entry].begin;
    if (p.chunk == nullptr) return file.WriteAt(base + offset, bytes);
    const TensorInfo& c = *p.chunk;
    const uint64_t item = base::DTypeSize(c.dtype);
    const size_t rank = c.shape.size();
    size_t k = rank;  // the chunk spans the whole array on axes k+1..
    while (k > 0 && (k == rank || c.shape[k] == c.chunk.global_shape[k])) --k;
    uint64_t run = item;  // bytes of one contiguous run
    for (size_t a = k; a < rank; ++a) run *= c.shape[a];
    std::vector<uint64_t> stride(rank + 1, item);  // bytes per index of each axis of the array
    for (size_t a = rank; a-- > 0;) stride[a] = stride[a + 1] * c.chunk.global_shape[a];
    while (!bytes.empty()) {
      uint64_t j = offset / run;  // the run, as an index over the axes before k
      const uint64_t within = offset % run;
      uint64_t at = c.chunk.start.empty() ? 0 : c.chunk.start[k] * stride[k + 1];
      for (size_t a = k; a-- > 0;) {
        at += (c.chunk.start[a] + j % c.shape[a]) * stride[a + 1];
        j /= c.shape[a];
      }
      const size_t n = static_cast<size_t>(std::min<uint64_t>(bytes.size(), run - within));
      RETURN_IF_ERROR(file.WriteAt(base + at + within, bytes.first(n)));
      bytes = bytes.subspan(n);
      offset += n;
    }
    return Status::Ok();
  }

 private:
  struct Place {
    size_t entry = 0;
    const TensorInfo* chunk = nullptr;  // the chunk, when the tensor is one
  };

  size_t Add(const std::string& name, DType dtype, const std::vector<uint64_t>& shape, uint64_t bytes) {
    entries_.push_back({name, dtype, shape, data_bytes_, data_bytes_ + bytes});
    data_bytes_ += bytes;
    return entries_.size() - 1;
  }

  std::vector<format::TensorEntry> entries_;
  std::vector<Place> places_;
  std::string prefix_;
  uint64_t data_bytes_ = 0;
  bool chunked_ = false;
};

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
  std::optional<Layout> layout;
  uint64_t written = 0;
  reader.begin = [&](int64_t s, const std::string& metadata_json, const std::vector<TensorInfo>& tensors) -> Status {
    layout.emplace(tensors, metadata_json);
    total = layout->size();
    // Chunks land in their arrays' boxes, out of order: buffered writes.
    const auto mode = layout->chunked() ? AtomicFile::Mode::kScattered : AtomicFile::Mode::kAppend;
    ASSIGN_OR_RETURN(AtomicFile f, AtomicFile::Create(out, mode));
    file.emplace(std::move(f));
    done.step = s;
    done.tensors = layout->tensors();
    const auto prefix = std::as_bytes(std::span(layout->prefix()));
    written = prefix.size();
    return layout->chunked() ? file->WriteAt(0, prefix) : file->Append(prefix);
  };
  reader.piece = [&](size_t tensor, uint64_t offset, std::span<const std::byte> bytes) -> Status {
    RETURN_IF_ERROR(layout->chunked() ? layout->Write(*file, tensor, offset, bytes) : file->Append(bytes));
    written += bytes.size();
    bar.Update(written, total);
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
                   "tensors as one safetensors file FILE (via FILE.tmp, fsynced, then renamed). An array saved\n"
                   "in chunks (a sharded jax.Array) is written as one tensor of its global shape.");
  parser.Positional("ROOT", "checkpoint root directory")
      .Flag("step", "N", "the step to export (default: the latest)")
      .Flag("out", "FILE", "the .safetensors file to write", ArgParser::Arity::kRequired);
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  return Report(Export(args));
}

}  // namespace ckptio::cli
