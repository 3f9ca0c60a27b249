// ManagerImpl's readers: Restore, RestoreInto, RestoreSlices, Info, Verify
// and the listing they pin steps against (see manager_impl.h). Each pins
// its step against this manager's pruning for the length of the read.

#include <map>
#include <set>

#include "base/status_macros.h"
#include "format/manifest.h"
#include "pipeline/manager_impl.h"
#include "pipeline/reader.h"

namespace ckptio::pipeline {
namespace {

// A restore into memory of a checkpoint larger than the machine's memory
// (a manifest can declare any size; its shard may be a sparse file) fails
// up front, naming the largest tensor, instead of in the allocator.
Status CheckFitsInMemory(const format::Manifest& m, const std::string& path) {
  const uint64_t memory = PhysicalMemory();
  if (memory == 0 || m.tensors.empty()) return Status::Ok();
  uint64_t total = 0;
  const format::ManifestTensor* largest = &m.tensors[0];
  for (const format::ManifestTensor& t : m.tensors) {
    total += t.bytes;
    if (t.bytes > largest->bytes) largest = &t;
  }
  if (total <= memory) return Status::Ok();
  return ResourceExhaustedError(path + ": restoring it needs " + FormatBytes(total) + " of memory (tensor \"" +
                                largest->name + "\" alone is " + FormatBytes(largest->bytes) +
                                "), more than this machine has (" + FormatBytes(memory) +
                                "): restore the tensors you need into your own buffers, or slices of them "
                                "(RestoreInto, RestoreSlices)");
}

}  // namespace

Result<int64_t> ManagerImpl::PinStep(std::optional<int64_t> step) {
  std::lock_guard lock(mu_);
  if (!step) {
    if (committed_.empty()) return NotFoundError("no committed checkpoint in " + root_);
    step = *committed_.rbegin();
  } else if (committed_.count(*step) == 0) {
    return NotFoundError("no committed checkpoint of step " + std::to_string(*step) + " in " + root_);
  }
  readers_.insert(*step);
  return *step;
}

void ManagerImpl::Unpin(int64_t step) {
  std::lock_guard lock(mu_);
  readers_.erase(readers_.find(step));
}

Task<Result<RestoredCheckpoint>> ManagerImpl::RestoreTask(int64_t step, const ProgressFn* progress) {
  runtime::ScopedSpan span(tracer_.get(), runtime::Track::kRead, "restore " + std::to_string(step));
  CO_ASSIGN_OR_RETURN(OpenedCheckpoint c, co_await OpenStep(step));
  CO_TRY(CheckFitsInMemory(c.manifest, c.path));
  RestoredCheckpoint out;
  out.step = step;
  out.metadata_json = c.manifest.metadata.dump();
  std::vector<size_t> indices;
  std::vector<char*> dsts;
  out.tensors.reserve(c.manifest.tensors.size());
  for (size_t i = 0; i < c.manifest.tensors.size(); ++i) {
    const format::ManifestTensor& t = c.manifest.tensors[i];
    Bytes bytes;
    try {
      bytes = Bytes(t.bytes);
    } catch (const std::bad_alloc&) {
      co_return ResourceExhaustedError(c.path + ": cannot allocate " + FormatBytes(t.bytes) + " for tensor \"" +
                                       t.name + "\"");
    }
    out.tensors.push_back({t.name, t.dtype, t.shape, std::move(bytes), t.chunk});
    indices.push_back(i);
    dsts.push_back(reinterpret_cast<char*>(out.tensors.back().bytes.data()));
  }
  CO_TRY(co_await ReadTensors(pool_.get(), &c, std::move(indices), std::move(dsts), progress));
  co_return std::move(out);
}

Result<RestoredCheckpoint> ManagerImpl::Restore(std::optional<int64_t> step, ProgressFn progress) {
  ReadHold hold(this);
  ASSIGN_OR_RETURN(int64_t s, PinStep(step));
  auto r = loop().BlockOn(RestoreTask(s, &progress));
  Unpin(s);
  if (!r.ok()) return ExplainReadFailure(s, std::move(r).status());
  return r;
}

namespace {

// Only the named tensors (a restore on many processes must not make each
// open every process's shards).
template <typename Wanted>
TensorFilter Named(std::span<const Wanted> wanted) {
  auto names = std::make_shared<std::set<std::string_view>>();
  for (const Wanted& w : wanted) names->insert(w.name);
  return [names](const format::ManifestTensor& t) { return names->count(t.name) != 0; };
}

// The tensors of an opened checkpoint by name, for restores that name them.
class TensorsByName {
 public:
  TensorsByName(const format::Manifest& m, int64_t step, const std::string& root) : step_(step), root_(root) {
    for (size_t i = 0; i < m.tensors.size(); ++i) index_[m.tensors[i].name] = i;
  }
  Result<size_t> Find(const std::string& name) const {
    auto it = index_.find(name);
    if (it == index_.end()) {
      return NotFoundError("step " + std::to_string(step_) + " in " + root_ + " has no tensor \"" + name + "\"");
    }
    return it->second;
  }

 private:
  std::map<std::string_view, size_t> index_;
  int64_t step_;
  const std::string& root_;
};

}  // namespace

Task<Status> ManagerImpl::RestoreIntoTask(int64_t step, std::span<const MutableTensorRef> tensors) {
  CO_ASSIGN_OR_RETURN(OpenedCheckpoint c, co_await OpenStep(step, Named(tensors)));
  const TensorsByName by_name(c.manifest, step, root_);
  std::vector<RangeRead> reads;
  for (const MutableTensorRef& want : tensors) {
    CO_ASSIGN_OR_RETURN(size_t index, by_name.Find(want.name));
    const format::ManifestTensor& t = c.manifest.tensors[index];
    if (t.dtype != want.dtype || t.shape != want.shape) {
      co_return InvalidArgumentError("tensor \"" + want.name + "\": the buffer is " +
                                     std::string(base::DTypeName(want.dtype)) + base::ShapeToString(want.shape) +
                                     " but step " + std::to_string(step) + " holds " +
                                     std::string(base::DTypeName(t.dtype)) + base::ShapeToString(t.shape));
    }
    if (t.bytes > 0 && want.data == nullptr) {
      co_return InvalidArgumentError("tensor \"" + want.name + "\": destination buffer is null");
    }
    reads.push_back({index, 0, t.bytes, static_cast<char*>(want.data)});  // whole: CRC-checked
  }
  co_return co_await ReadRanges(pool_.get(), &c, reads);
}

namespace {

// Whether `want` lies within its tensor of `bytes` bytes, rows and all, and
// its rows within a destination that does not wrap around.
Status CheckSlice(const TensorSlice& want, uint64_t bytes) {
  const std::string tensor = "tensor \"" + want.name + "\"";
  if (want.rows > 1 && (want.stride < want.length || want.dst_stride < want.length)) {
    return InvalidArgumentError(tensor + ": a slice of " + std::to_string(want.rows) + " rows of " +
                                std::to_string(want.length) + " bytes needs a stride and a dst_stride of at least " +
                                std::to_string(want.length) + ", got " + std::to_string(want.stride) + " and " +
                                std::to_string(want.dst_stride));
  }
  // The last row's start: offset + (rows - 1) * stride, which must not pass
  // bytes - length (no overflow: each step checked against what is left).
  const uint64_t last = want.rows > 1 ? want.rows - 1 : 0;
  const bool fits = want.offset <= bytes && want.length <= bytes - want.offset &&
                    (last == 0 || (want.stride > 0 && last <= (bytes - want.offset - want.length) / want.stride));
  if (!fits) {
    return InvalidArgumentError(tensor + " has " + std::to_string(bytes) + " bytes: the slice of " +
                                (want.rows > 1 ? std::to_string(want.rows) + " rows of " : std::string()) +
                                std::to_string(want.length) + " bytes at offset " + std::to_string(want.offset) +
                                (want.rows > 1 ? " (stride " + std::to_string(want.stride) + ")" : std::string()) +
                                " is out of range");
  }
  uint64_t extent = 0;
  if (last > 0 && (__builtin_mul_overflow(last, want.dst_stride, &extent) ||
                   __builtin_add_overflow(extent, want.length, &extent) ||
                   __builtin_add_overflow(reinterpret_cast<uintptr_t>(want.data), extent, &extent))) {
    return InvalidArgumentError(tensor + ": the slice's rows at dst_stride " + std::to_string(want.dst_stride) +
                                " run past the end of the address space");
  }
  if (want.length > 0 && want.rows > 0 && want.data == nullptr) {
    return InvalidArgumentError(tensor + ": destination buffer is null");
  }
  return Status::Ok();
}

}  // namespace

Task<Status> ManagerImpl::RestoreSlicesTask(int64_t step, std::span<const TensorSlice> slices) {
  CO_ASSIGN_OR_RETURN(OpenedCheckpoint c, co_await OpenStep(step, Named(slices)));
  const TensorsByName by_name(c.manifest, step, root_);
  std::vector<RangeRead> reads;
  for (const TensorSlice& want : slices) {
    CO_ASSIGN_OR_RETURN(size_t index, by_name.Find(want.name));
    const format::ManifestTensor& t = c.manifest.tensors[index];
    CO_TRY(CheckSlice(want, t.bytes));
    reads.push_back({index, want.offset, want.length, static_cast<char*>(want.data), want.rows, want.stride,
                     want.dst_stride});
  }
  co_return co_await ReadRanges(pool_.get(), &c, reads);
}

Result<int64_t> ManagerImpl::RestoreSlices(std::optional<int64_t> step, std::span<const TensorSlice> slices) {
  ReadHold hold(this);
  ASSIGN_OR_RETURN(int64_t s, PinStep(step));
  Status st = loop().BlockOn(RestoreSlicesTask(s, slices));
  Unpin(s);
  RETURN_IF_ERROR(ExplainReadFailure(s, std::move(st)));
  return s;
}

Result<int64_t> ManagerImpl::RestoreInto(std::optional<int64_t> step, std::span<const MutableTensorRef> tensors) {
  ReadHold hold(this);
  ASSIGN_OR_RETURN(int64_t s, PinStep(step));
  Status st = loop().BlockOn(RestoreIntoTask(s, tensors));
  Unpin(s);
  RETURN_IF_ERROR(ExplainReadFailure(s, std::move(st)));
  return s;
}

std::vector<int64_t> ManagerImpl::AllSteps() const {
  std::lock_guard lock(mu_);
  return {committed_.begin(), committed_.end()};
}

std::optional<int64_t> ManagerImpl::LatestStep() const {
  std::vector<int64_t> all = AllSteps();
  if (all.empty()) return std::nullopt;
  return all.back();
}

Task<Result<std::string>> ManagerImpl::ReadManifestBytes(int64_t step) {
  co_return co_await storage_->ReadSmallFile(StepName(step), "manifest.json", format::kMaxManifestBytes);
}

Task<Result<format::Manifest>> ManagerImpl::ReadManifest(int64_t step) {
  const std::string path = root_ + "/" + StepName(step) + "/manifest.json";
  CO_ASSIGN_OR_RETURN(std::string bytes, co_await ReadManifestBytes(step));
  CO_ASSIGN_OR_RETURN(format::Manifest m, format::ParseManifest(path, bytes));
  CO_TRY(ManifestIsStep(path, m, step));
  co_return std::move(m);
}

Status ManagerImpl::ManifestIsStep(const std::string& path, const format::Manifest& m, int64_t step) {
  if (m.step == step) return Status::Ok();
  return CorruptionError(path + ": says step " + std::to_string(m.step) + ", but the directory is step " +
                         std::to_string(step));
}

Status ManagerImpl::ExplainReadFailure(int64_t step, Status failure) {
  if (failure.ok()) return failure;
  // Only a read-only manager can see a step vanish: a writer's own prunes
  // wait for its readers (PinStep), and no one else prunes its root.
  if (read_only_ && loop().BlockOn(Refresh(/*remove_debris=*/false)).ok()) {
    std::lock_guard lock(mu_);
    if (committed_.count(step) == 0) {
      return NotFoundError("step " + std::to_string(step) + " in " + root_ +
                           " was removed (pruned or deleted) while it was being read");
    }
  }
  return failure;
}

Result<CheckpointInfo> ManagerImpl::Info(int64_t step) {
  ASSIGN_OR_RETURN(int64_t s, PinStep(step));
  auto read = loop().BlockOn(ReadManifest(s));
  Unpin(s);
  if (!read.ok()) return ExplainReadFailure(s, std::move(read).status());
  format::Manifest m = std::move(read).value();
  CheckpointInfo info;
  info.step = m.step;
  info.created = m.created;
  for (const auto& s : m.shards) {
    info.bytes += s.bytes;
    if (!s.checkpoint.empty()) info.bytes_in_earlier += s.bytes;
  }
  info.tensors = m.tensors.size();
  info.shards = m.shards.size();
  info.metadata_json = m.metadata.dump();
  info.tensor_list.reserve(m.tensors.size());
  for (format::ManifestTensor& t : m.tensors) {
    info.tensor_list.push_back({std::move(t.name), t.dtype, std::move(t.shape), t.bytes, std::move(t.chunk)});
  }
  return info;
}

Task<Result<VerifyReport>> ManagerImpl::VerifyTask(int64_t step, const ProgressFn* progress) {
  runtime::ScopedSpan span(tracer_.get(), runtime::Track::kRead, "verify " + std::to_string(step));
  // A host's part of a multi-host step (two tiers) is verified as this host
  // holds it: the other processes' files are on their hosts.
  CO_ASSIGN_OR_RETURN(OpenedCheckpoint c, co_await OpenStep(step, {}, /*held_only=*/true));
  CO_ASSIGN_OR_RETURN(uint64_t bytes, co_await VerifyAll(pool_.get(), &c, progress));
  co_return VerifyReport{step, bytes, c.manifest.tensors.size(), c.manifest.shards.size()};
}

Result<VerifyReport> ManagerImpl::Verify(std::optional<int64_t> step, ProgressFn progress) {
  ReadHold hold(this);
  ASSIGN_OR_RETURN(int64_t s, PinStep(step));
  auto r = loop().BlockOn(VerifyTask(s, &progress));
  Unpin(s);
  if (!r.ok()) return ExplainReadFailure(s, std::move(r).status());
  return r;
}

}  // namespace ckptio::pipeline
