#pragma once
// Reading checkpoints back: the manifest and every shard header validated
// before any tensor byte is touched, every tensor checked against its CRC32C.
// Runs on the loop thread; CRC work goes to the pool.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "ckptio/status.h"
#include "ckptio/task.h"
#include "format/manifest.h"
#include "format/safetensors.h"
#include "runtime/cpu_pool.h"
#include "storage/storage.h"

namespace ckptio::pipeline {

struct OpenedCheckpoint {
  std::string name;  // "checkpoint_200"
  std::string path;  // root + "/" + name, for messages
  format::Manifest manifest;
  std::vector<std::unique_ptr<storage::ReadableFile>> shards;  // by manifest shard index
};

// Reads and validates the manifest, opens every shard, and checks each
// shard's size and safetensors header against the manifest.
Task<Result<OpenedCheckpoint>> OpenCheckpoint(storage::Storage* storage, std::string name);

// Reads tensors (indices into manifest.tensors) into dsts[i], which must hold
// each tensor's bytes, and checks each tensor's CRC32C.
// `progress` (may be null or empty) hears of every piece read.
Task<Status> ReadTensors(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, std::vector<size_t> tensors,
                         std::vector<char*> dsts, const ProgressFn* progress);

// Re-reads every byte of every shard; checks every tensor's and every shard's
// CRC32C. Returns the bytes read.
Task<Result<uint64_t>> VerifyAll(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const ProgressFn* progress);

}  // namespace ckptio::pipeline
