#pragma once
// The snapshot: the only part of a save the trainer waits for.

#include <cstdint>
#include <vector>

#include "format/content_hash.h"
#include "runtime/task.h"
#include "pipeline/save_plan.h"
#include "runtime/cpu_pool.h"

namespace ckptio::pipeline {

// Copies the shard prefixes and every chunk's bytes into staging, split
// across the calling thread and the pool. If chunk_crc is given, computes
// each chunk's CRC32C right after copying it, while it is still in cache
// (the "fused" mode). Blocks until done; call from the trainer's thread.
void CopySnapshot(runtime::CpuPool& pool, const SavePlan& plan, char* region, const std::vector<Chunk>& chunks,
                  std::vector<uint32_t>* chunk_crc);

// Computes each chunk's CRC32C (over dst if set, else src) on the pool,
// `lanes` chunks at a time, from a coroutine on the loop thread. Small jobs,
// so a trainer's urgent snapshot work is never stuck behind them for long.
// With `hashes` (incremental saves), also each chunk's XXH3-128, in the same
// job. Either output may be null.
// REQUIRES: chunks and outputs outlive the task; outputs sized as chunks.
Task<void> ComputeChunkCrcs(runtime::CpuPool& pool, const std::vector<Chunk>* chunks, std::vector<uint32_t>* out,
                            size_t lanes, std::vector<format::Hash128>* hashes = nullptr);

}  // namespace ckptio::pipeline
