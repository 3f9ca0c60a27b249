#include "pipeline/save_plan.h"

#include <chrono>
#include <cstdio>
#include <algorithm>
#include <map>

#include "base/align.h"
#include "base/status_macros.h"
#include "format/crc32c.h"
#include "pipeline/host_part.h"
#include "pipeline/staging.h"

namespace ckptio::pipeline {
namespace {
using base::RoundUp;

// Copying this many bytes through the bounce buffers (~1 ms) costs about what
// a shard file's create, fdatasync and manifest entry do.
constexpr uint64_t kOwnShardBytes = uint64_t{16} << 20;

// The manifest's chunk checks, before anything is copied: a chunk outside its
// array, overlapping another, or (one process saving) missing is the caller's
// error, reported as InvalidArgument at Save().
Status CheckChunksToSave(const SavePlan& plan, const Options& options) {
  std::vector<format::ManifestTensor> tensors(plan.specs.size());
  for (size_t i = 0; i < plan.specs.size(); ++i) {
    tensors[i].name = plan.specs[i].name;
    tensors[i].dtype = plan.specs[i].dtype;
    tensors[i].shape = plan.specs[i].shape;
    tensors[i].chunk = plan.chunks[i];
  }
  const auto completeness = options.multihost.process_count > 1 ? format::Chunks::kPartial : format::Chunks::kComplete;
  Status s = format::CheckChunks("save", tensors, completeness);
  return s.ok() ? s : InvalidArgumentError(s.message());
}
}  // namespace

Result<SavePlan> PlanSave(int64_t step, std::span<const TensorRef> tensors, const Options& options,
                          std::optional<SnapshotMode> snapshot, uint32_t address_modulus) {
  if (step < 0) return InvalidArgumentError("step must be >= 0, got " + std::to_string(step));
  SavePlan plan;
  plan.step = step;
  plan.borrow = snapshot.value_or(options.snapshot) == SnapshotMode::kBorrow;
  plan.specs.reserve(tensors.size());
  plan.sources.reserve(tensors.size());
  bool chunked = false;
  for (const TensorRef& t : tensors) {
    std::string name = t.chunk.empty() || !t.name.empty() ? t.name : ChunkName(t.chunk.array, t.chunk.start);
    auto bytes = base::TensorBytes(t.dtype, t.shape);
    if (!bytes.ok()) return bytes.status().WithContext("tensor \"" + name + "\"");
    if (*bytes > 0 && t.data == nullptr) {
      return InvalidArgumentError("tensor \"" + name + "\": data is null but it holds " +
                                  std::to_string(*bytes) + " bytes");
    }
    chunked |= !t.chunk.empty();
    plan.specs.push_back({std::move(name), t.dtype, t.shape, *bytes});
    plan.sources.push_back(static_cast<const char*>(t.data));
    plan.chunks.push_back(t.chunk);
    plan.local_copy.push_back(t.local_copy);
    if (t.local_copy && (options.multihost.process_count <= 1 || options.tiers.remote.empty())) {
      return InvalidArgumentError("tensor \"" + plan.specs.back().name +
                                  "\": local_copy is for multi-host saves with two tiers (multihost.process_count "
                                  "> 1 and tiers.remote set)");
    }
  }
  if (chunked) RETURN_IF_ERROR(CheckChunksToSave(plan, options));
  std::vector<uint32_t> residue;
  format::MemoryResidues residues;
  if (plan.borrow && address_modulus != 0) {
    std::map<uint32_t, uint64_t> class_bytes;
    for (size_t i = 0; i < plan.sources.size(); ++i) {
      residue.push_back(static_cast<uint32_t>(reinterpret_cast<uintptr_t>(plan.sources[i]) % address_modulus));
      class_bytes[residue.back()] += plan.specs[i].bytes;
    }
    // A residue class gets shards of its own only if copying its bytes would
    // cost more than another file; a smaller one joins the largest class (its
    // tensors are then copied through the bounce buffers, as before).
    uint32_t largest = 0;
    uint64_t largest_bytes = 0;
    for (const auto& [r, bytes] : class_bytes) {
      if (bytes > largest_bytes) largest = r, largest_bytes = bytes;
    }
    for (uint32_t& r : residue) {
      if (class_bytes.at(r) < kOwnShardBytes) r = largest;
    }
    residues = {residue, address_modulus};
  }
  ASSIGN_OR_RETURN(plan.shards, PlanShardFiles(plan.specs, plan.local_copy, options, residues));
  uint64_t offset = 0;
  for (const format::PlannedShard& s : plan.shards) {
    plan.prefix_crc.push_back(format::Crc32c(s.prefix.data(), s.prefix.size()));
    plan.image_offset.push_back(offset);
    offset += RoundUp(plan.borrow ? s.prefix.size() : s.file_size, StagingPool::kAlign);
    plan.checkpoint_bytes += s.file_size;
  }
  plan.staging_bytes = offset;
  return plan;
}

Result<std::vector<format::PlannedShard>> PlanShardFiles(std::span<const format::TensorSpec> specs,
                                                         const std::vector<bool>& local_copy, const Options& options,
                                                         format::MemoryResidues residues) {
  const int process = options.multihost.process_index, count = options.multihost.process_count;
  if (std::find(local_copy.begin(), local_copy.end(), true) == local_copy.end()) {
    return format::PlanShards(specs, options.shard_size, StagingPool::kAlign, ShardFilePrefix(process, count, false),
                              residues);
  }
  std::vector<format::PlannedShard> out;
  for (const bool copies : {false, true}) {
    std::vector<size_t> index;  // group spec -> spec
    std::vector<format::TensorSpec> group;
    std::vector<uint32_t> residue;
    for (size_t i = 0; i < specs.size(); ++i) {
      if (local_copy[i] != copies) continue;
      index.push_back(i);
      group.push_back(specs[i]);
      if (residues.modulus != 0) residue.push_back(residues.residue[i]);
    }
    const format::MemoryResidues group_residues{residue, residues.modulus};
    ASSIGN_OR_RETURN(std::vector<format::PlannedShard> shards,
                     format::PlanShards(group, options.shard_size, StagingPool::kAlign,
                                        ShardFilePrefix(process, count, copies), group_residues));
    for (format::PlannedShard& shard : shards) {
      for (format::PlannedTensor& t : shard.tensors) t.index = index[t.index];
      out.push_back(std::move(shard));
    }
  }
  return out;
}

std::vector<Chunk> MakeChunks(const SavePlan& plan, char* region, size_t piece) {
  std::vector<Chunk> chunks;
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    char* image = plan.borrow ? nullptr : region + plan.image_offset[s];
    for (const format::PlannedTensor& t : plan.shards[s].tensors) {
      const char* src = plan.sources[t.index];
      for (uint64_t off = 0; off < t.bytes; off += piece) {
        size_t len = static_cast<size_t>(std::min<uint64_t>(piece, t.bytes - off));
        chunks.push_back({t.index, src + off, image ? image + t.offset + off : nullptr, len});
      }
    }
  }
  return chunks;
}

std::vector<uint32_t> CombineChunkCrcs(const SavePlan& plan, const std::vector<Chunk>& chunks,
                                       const std::vector<uint32_t>& chunk_crc) {
  std::vector<uint32_t> crc(plan.specs.size(), 0);  // CRC32C of no bytes is 0
  std::vector<bool> started(plan.specs.size(), false);
  for (size_t i = 0; i < chunks.size(); ++i) {
    size_t t = chunks[i].tensor;
    crc[t] = started[t] ? format::Crc32cCombine(crc[t], chunk_crc[i], chunks[i].len) : chunk_crc[i];
    started[t] = true;
  }
  return crc;
}

std::vector<uint32_t> ShardCrcs(const SavePlan& plan, const std::vector<uint32_t>& tensor_crc) {
  std::vector<uint32_t> out;
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    uint32_t crc = plan.prefix_crc[s];
    for (const format::PlannedTensor& t : plan.shards[s].tensors) {
      crc = format::Crc32cCombine(crc, tensor_crc[t.index], t.bytes);
    }
    out.push_back(crc);
  }
  return out;
}

std::vector<storage::FileImage> MakeImages(const SavePlan& plan, char* region) {
  std::vector<storage::FileImage> images;
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    const format::PlannedShard& shard = plan.shards[s];
    storage::FileImage image;
    image.name = shard.name;
    image.size = shard.file_size;
    // No region: the prefix is the plan's own (an incremental save's plan of
    // what it writes, whose tensors sit wherever the snapshot left them).
    const char* base = region != nullptr ? region + plan.image_offset[s] : shard.prefix.data();
    if (!plan.borrow) {
      image.segments.push_back({0, base, shard.file_size, RoundUp(shard.file_size, StagingPool::kAlign)});
    } else {
      image.segments.push_back({0, base, shard.prefix.size(), shard.prefix.size()});
      for (const format::PlannedTensor& t : shard.tensors) {
        if (t.bytes > 0) image.segments.push_back({t.offset, plan.sources[t.index], t.bytes, t.bytes});
      }
    }
    images.push_back(std::move(image));
  }
  return images;
}

format::Manifest MakeManifest(const SavePlan& plan, const std::vector<uint32_t>& tensor_crc,
                              const std::vector<uint32_t>& shard_crc, nlohmann::json metadata,
                              const std::vector<format::Hash128>* tensor_hash) {
  format::Manifest m;
  m.step = plan.step;
  m.created = format::FormatRfc3339Utc(std::chrono::system_clock::now());
  m.writer = std::string("ckptio ") + CKPTIO_VERSION;
  m.metadata = std::move(metadata);
  // The tensors in the order they were given (a borrowing save may have laid
  // them out in another: PlanSave), so that Restore lists them as saved.
  m.tensors.resize(plan.specs.size());
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    m.shards.push_back({plan.shards[s].name, plan.shards[s].file_size, shard_crc[s], {}});
    for (const format::PlannedTensor& t : plan.shards[s].tensors) {
      const format::TensorSpec& spec = plan.specs[t.index];
      std::optional<format::Hash128> hash;
      if (tensor_hash != nullptr) hash = (*tensor_hash)[t.index];
      m.tensors[t.index] = {spec.name, spec.dtype, spec.shape, static_cast<uint32_t>(s), t.offset, t.bytes,
                            tensor_crc[t.index], plan.chunks[t.index], hash};
    }
  }
  m.format_version = format::FormatVersionFor(m);
  return m;
}

}  // namespace ckptio::pipeline
