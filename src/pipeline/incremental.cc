#include "pipeline/incremental.h"

#include <chrono>
#include <unordered_map>

#include "base/status_macros.h"
#include "format/crc32c.h"
#include "pipeline/staging.h"

namespace ckptio::pipeline {

std::vector<std::optional<size_t>> MatchBase(const SavePlan& plan, const std::vector<uint32_t>& tensor_crc,
                                             const std::vector<format::Hash128>& tensor_hash,
                                             const format::Manifest& base) {
  std::unordered_map<std::string_view, size_t> by_name;
  for (size_t i = 0; i < base.tensors.size(); ++i) by_name.emplace(base.tensors[i].name, i);
  std::vector<std::optional<size_t>> reuse(plan.specs.size());
  for (size_t i = 0; i < plan.specs.size(); ++i) {
    const format::TensorSpec& spec = plan.specs[i];
    auto it = by_name.find(spec.name);
    if (it == by_name.end()) continue;
    const format::ManifestTensor& t = base.tensors[it->second];
    const bool same = t.xxh3 && *t.xxh3 == tensor_hash[i] && t.crc32c == tensor_crc[i] && t.dtype == spec.dtype &&
                      t.shape == spec.shape && t.bytes == spec.bytes && t.chunk.array == plan.chunks[i].array &&
                      t.chunk.global_shape == plan.chunks[i].global_shape && t.chunk.start == plan.chunks[i].start;
    if (same) reuse[i] = it->second;
  }
  return reuse;
}

Result<SavePlan> PlanChanged(const SavePlan& plan, char* region, const std::vector<std::optional<size_t>>& reuse,
                             const Options& options, std::vector<size_t>* from) {
  // Where each tensor's bytes are now.
  std::vector<const char*> where(plan.specs.size(), nullptr);
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    for (const format::PlannedTensor& t : plan.shards[s].tensors) {
      where[t.index] = plan.borrow ? plan.sources[t.index] : region + plan.image_offset[s] + t.offset;
    }
  }
  SavePlan changed;
  changed.step = plan.step;
  changed.borrow = true;
  from->clear();
  for (size_t i = 0; i < plan.specs.size(); ++i) {
    if (reuse[i]) continue;
    from->push_back(i);
    changed.specs.push_back(plan.specs[i]);
    changed.sources.push_back(where[i]);
    changed.chunks.push_back(plan.chunks[i]);
    changed.local_copy.push_back(plan.local_copy[i]);
  }
  // Named as the plan's files are: a multi-host save's after its process.
  ASSIGN_OR_RETURN(changed.shards, PlanShardFiles(changed.specs, changed.local_copy, options));
  for (const format::PlannedShard& s : changed.shards) {
    changed.prefix_crc.push_back(format::Crc32c(s.prefix.data(), s.prefix.size()));
    changed.image_offset.push_back(0);  // unused: prefixes live in the plan
    changed.checkpoint_bytes += s.file_size;
  }
  return changed;
}

format::Manifest MakeIncrementalManifest(const SavePlan& plan, const SavePlan& changed, const std::vector<size_t>& from,
                                         const std::vector<uint32_t>& tensor_crc,
                                         const std::vector<format::Hash128>& tensor_hash,
                                         const std::vector<uint32_t>& changed_shard_crc,
                                         const std::vector<std::optional<size_t>>& reuse, const IncrementalBase& base,
                                         nlohmann::json metadata) {
  std::vector<uint32_t> changed_crc;
  std::vector<format::Hash128> changed_hash;
  for (size_t i : from) {
    changed_crc.push_back(tensor_crc[i]);
    changed_hash.push_back(tensor_hash[i]);
  }
  format::Manifest m = MakeManifest(changed, changed_crc, changed_shard_crc, std::move(metadata), &changed_hash);
  // PlanShards keeps its input order, so the written tensors are listed in
  // the changed plan's order: the caller's order without the reused ones.
  std::vector<format::ManifestTensor> written = std::move(m.tensors);
  m.tensors.clear();
  size_t next_written = 0;
  std::unordered_map<std::string, uint32_t> ref_index;  // Path() -> index in m.shards
  for (size_t i = 0; i < plan.specs.size(); ++i) {
    if (!reuse[i]) {
      m.tensors.push_back(std::move(written[next_written++]));
      continue;
    }
    format::ManifestTensor t = base.manifest.tensors[*reuse[i]];
    format::ManifestShard shard = base.manifest.shards[t.shard];
    if (shard.checkpoint.empty()) shard.checkpoint = base.name;
    auto [it, added] = ref_index.emplace(shard.Path(), static_cast<uint32_t>(m.shards.size()));
    if (added) m.shards.push_back(std::move(shard));
    t.shard = it->second;
    m.tensors.push_back(std::move(t));
  }
  m.format_version = format::FormatVersionFor(m);
  return m;
}

void AddReferences(const format::Manifest& manifest, References* out) {
  for (const format::ManifestShard& s : manifest.shards) {
    if (!s.checkpoint.empty()) (*out)[s.checkpoint].insert(s.name);
  }
}

std::vector<format::Hash128> CombineChunkHashes(const SavePlan& plan, const std::vector<Chunk>& chunks,
                                                const std::vector<format::Hash128>& chunk_hash) {
  std::vector<std::vector<format::Hash128>> pieces(plan.specs.size());
  for (size_t i = 0; i < chunks.size(); ++i) pieces[chunks[i].tensor].push_back(chunk_hash[i]);
  std::vector<format::Hash128> out;
  out.reserve(pieces.size());
  for (const auto& p : pieces) out.push_back(format::CombinePieceHashes(p));
  return out;
}

}  // namespace ckptio::pipeline
