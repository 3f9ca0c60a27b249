#pragma once
// Incremental saves (Options::incremental): a tensor whose bytes did not
// change since the base (the last committed step) is not written again; the
// new manifest points into the shard that holds it (format/manifest.h,
// format_version 3). Changed means: a different XXH3-128 content hash or
// CRC32C, or a different name, dtype, shape or place in its array. Never
// decided by CRC32C alone.

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ckptio/options.h"
#include "ckptio/status.h"
#include "format/content_hash.h"
#include "format/manifest.h"
#include "pipeline/save_plan.h"

namespace ckptio::pipeline {

// The committed step an incremental save compares against.
struct IncrementalBase {
  int64_t step = 0;
  std::string name;  // its checkpoint name ("checkpoint_100")
  format::Manifest manifest;
};

// For each tensor of `plan` (by spec index), the index of the base tensor
// holding the same bytes, or nullopt (changed, new, or the base has no hash).
std::vector<std::optional<size_t>> MatchBase(const SavePlan& plan, const std::vector<uint32_t>& tensor_crc,
                                             const std::vector<format::Hash128>& tensor_hash,
                                             const format::Manifest& base);

// What is written: the tensors of `plan` that `reuse` does not match, laid
// out in new shards, each tensor's bytes taken from where the snapshot left
// them (staging at `region`, or the caller's buffer when borrowed). The plan
// is in borrow form (MakeImages(changed, nullptr)). from[k] is the spec index
// in `plan` of the changed plan's spec k.
Result<SavePlan> PlanChanged(const SavePlan& plan, char* region, const std::vector<std::optional<size_t>>& reuse,
                             const Options& options, std::vector<size_t>* from);

// The manifest of an incremental save: the written tensors in their new
// shards, the others in the base's shards (named by the checkpoint that
// stores them), every tensor with its hash, in the caller's order.
format::Manifest MakeIncrementalManifest(const SavePlan& plan, const SavePlan& changed, const std::vector<size_t>& from,
                                         const std::vector<uint32_t>& tensor_crc,
                                         const std::vector<format::Hash128>& tensor_hash,
                                         const std::vector<uint32_t>& changed_shard_crc,
                                         const std::vector<std::optional<size_t>>& reuse, const IncrementalBase& base,
                                         nlohmann::json metadata);

// The files of other checkpoints a manifest refers to: checkpoint name ->
// file names.
using References = std::map<std::string, std::set<std::string>>;
void AddReferences(const format::Manifest& manifest, References* out);

// Per-tensor hashes from per-chunk hashes (chunks in MakeChunks order, each
// format::kHashPiece bytes but a tensor's last).
std::vector<format::Hash128> CombineChunkHashes(const SavePlan& plan, const std::vector<Chunk>& chunks,
                                                const std::vector<format::Hash128>& chunk_hash);

}  // namespace ckptio::pipeline
