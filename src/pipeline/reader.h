#pragma once
// Reading checkpoints back: the manifest and every shard header validated
// before any tensor byte is touched, every tensor checked against its CRC32C.
// Runs on the loop thread; CRC work goes to the pool.

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "ckptio/status.h"
#include "runtime/task.h"
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
  // If set, the bytes of tensor data read are added here.
  std::atomic<uint64_t>* bytes_read = nullptr;
};

// Which shards to open (by manifest shard index), decided once the manifest
// is read; empty: all of them.
using ShardFilter = std::function<std::vector<bool>(const format::Manifest&)>;

// Which tensors a read needs (the shards holding them are opened); empty:
// all of them.
using TensorFilter = std::function<bool(const format::ManifestTensor&)>;

// Reads and validates the manifest, opens the shards (every one, or those
// `filter` picks; the others stay null), and checks each opened shard's size
// and safetensors header against the manifest.
Task<Result<OpenedCheckpoint>> OpenCheckpoint(storage::Storage* storage, std::string name, ShardFilter filter = {});

// Opens shard i of `c` (whose manifest is read and validated) from
// sources[i], for each i with a non-null source, and checks it against the
// manifest as OpenCheckpoint does. With `subset`, a file may hold tensors the
// manifest does not place in it (a read that takes them from elsewhere).
Task<Status> OpenShards(OpenedCheckpoint* c, std::vector<storage::Storage*> sources, bool subset);

// Reads tensors (indices into manifest.tensors) into dsts[i], which must hold
// each tensor's bytes, and checks each tensor's CRC32C.
// `progress` (may be null or empty) hears of every piece read.
Task<Status> ReadTensors(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, std::vector<size_t> tensors,
                         std::vector<char*> dsts, const ProgressFn* progress);

// A byte range of a tensor (index into manifest.tensors) to read into dst,
// or `rows` of them: row i is the `len` bytes at offset + i * stride of the
// tensor's data, read to dst + i * dst_stride (a box of a row-major array:
// the columns of a chunk that one device holds).
struct RangeRead {
  size_t tensor;
  uint64_t offset;  // into the tensor's data
  uint64_t len;     // of each row
  char* dst;
  uint64_t rows = 1;
  uint64_t stride = 0;      // REQUIRES (rows > 1): >= len
  uint64_t dst_stride = 0;  // REQUIRES (rows > 1): >= len
};

// Reads the ranges, in parallel: each run of a tensor's bytes is read once,
// in file order, by vectored reads that put each row straight into its
// destination (a range that overlaps another's is copied from it), or
// through the lanes' bounce buffers that copy each row out. Ranges of many
// short rows are read a window of their tensor at a time (about 64 Ki rows
// per group of windows), so the bookkeeping stays bounded. Every
// tensor read is checked against its CRC32C: the bytes of a tensor that no
// range covers are read too (not kept).
// REQUIRES: each range within its tensor; destinations do not overlap.
Task<Status> ReadRanges(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const std::vector<RangeRead>& reads,
                        const ProgressFn* progress = nullptr);

// A byte range of a tensor's data (index into manifest.tensors), read into
// dst by ReadTensorPieces.
struct TensorPieceRead {
  size_t tensor;
  uint64_t offset;  // into the tensor's data
  size_t len;
  char* dst;
};

// Reads the pieces (in parallel) and sets (*crcs)[i] to the CRC32C of piece
// i, for a caller that checks whole tensors piece by piece. REQUIRES: each
// piece within its tensor; *reads outlives the task.
Task<Status> ReadTensorPieces(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const std::vector<TensorPieceRead>* reads,
                              std::vector<uint32_t>* crcs);

// The error for a tensor whose bytes have CRC32C `got` instead of the
// manifest's.
Status TensorCrcMismatch(const OpenedCheckpoint& ckpt, size_t tensor, uint32_t got);

// Re-reads every byte of every shard; checks every tensor's and every shard's
// CRC32C. Returns the bytes read.
Task<Result<uint64_t>> VerifyAll(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const ProgressFn* progress);

}  // namespace ckptio::pipeline
