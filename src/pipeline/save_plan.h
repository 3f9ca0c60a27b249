#pragma once
// SavePlan: how one save lays out its tensors, in files and in staging.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ckptio/options.h"
#include "ckptio/status.h"
#include "ckptio/tensor.h"
#include "format/manifest.h"
#include "format/safetensors.h"
#include "storage/storage.h"

namespace ckptio::pipeline {

struct SavePlan {
  int64_t step = 0;
  std::vector<format::TensorSpec> specs;  // in the caller's order
  std::vector<const char*> sources;       // the caller's buffers, by spec index
  std::vector<ChunkOf> chunks;            // by spec index: where a chunk sits in its array
  std::vector<bool> local_copy;           // by spec index: TensorRef::local_copy
  std::vector<format::PlannedShard> shards;
  std::vector<uint32_t> prefix_crc;       // CRC32C of each shard's prefix
  // Copy mode: each shard's whole file image sits in staging at
  // image_offset[i] (relative to the save's region), padded to a block.
  // Borrow mode: only its prefix does.
  std::vector<uint64_t> image_offset;
  uint64_t staging_bytes = 0;     // size of the save's staging region
  uint64_t checkpoint_bytes = 0;  // sum of shard file sizes
  bool borrow = false;
};

// Validates the tensors (names, dtypes, shapes, null data, chunks of arrays)
// and plans shards. Errors are InvalidArgument naming the tensor. A chunk's
// empty name is filled in (ChunkName). The chunks of each array must cover it
// unless this is one process's part of a multi-host save.
// Multi-host saves name shards after the process ("shard-p00003-00000...").
// `snapshot`, if set, replaces options.snapshot for this save. A borrowing
// save with an `address_modulus` (Storage::AddressModulus) lays its tensors
// out so that their file offsets agree with their addresses modulo it
// (format::MemoryResidues): the writer then sends them without a copy.
Result<SavePlan> PlanSave(int64_t step, std::span<const TensorRef> tensors, const Options& options,
                          std::optional<SnapshotMode> snapshot = std::nullopt, uint32_t address_modulus = 0);

// The byte ranges CRC32C is computed over: every tensor split into pieces of
// at most `piece` bytes. `dst` is where the bytes land in staging (copy mode)
// or null (borrow mode).
struct Chunk {
  size_t tensor;
  const char* src;
  char* dst;
  size_t len;
};
std::vector<Chunk> MakeChunks(const SavePlan& plan, char* region, size_t piece);

// Per-tensor CRCs from per-chunk CRCs (chunks in MakeChunks order).
std::vector<uint32_t> CombineChunkCrcs(const SavePlan& plan, const std::vector<Chunk>& chunks,
                                       const std::vector<uint32_t>& chunk_crc);

// Each shard's whole-file CRC from its prefix CRC and its tensors' CRCs.
std::vector<uint32_t> ShardCrcs(const SavePlan& plan, const std::vector<uint32_t>& tensor_crc);

// The file images the storage writes, pointing into `region` (and, in
// borrow mode, into the caller's buffers). With a null region (borrow mode
// only), prefixes point into plan.shards[i].prefix.
std::vector<storage::FileImage> MakeImages(const SavePlan& plan, char* region);

// The shards of `specs` (format::PlanShards, named by ShardFilePrefix): the
// local copies (by spec index) in shards of their own, after the others.
Result<std::vector<format::PlannedShard>> PlanShardFiles(std::span<const format::TensorSpec> specs,
                                                         const std::vector<bool>& local_copy,
                                                         const Options& options,
                                                         format::MemoryResidues residues = {});

// `tensor_hash`, if given: each tensor's content hash, recorded in the manifest.
format::Manifest MakeManifest(const SavePlan& plan, const std::vector<uint32_t>& tensor_crc,
                              const std::vector<uint32_t>& shard_crc, nlohmann::json metadata,
                              const std::vector<format::Hash128>* tensor_hash = nullptr);

}  // namespace ckptio::pipeline
