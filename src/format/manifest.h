#pragma once
// The checkpoint manifest, manifest.json: the commit point of a checkpoint (a
// checkpoint exists iff its manifest does) and the only index a reader trusts.
// It lists every shard (name, bytes, CRC32C) and every tensor (name, dtype,
// shape, shard, absolute offset in the shard file, bytes, CRC32C).
//
// JSON layout (format_version 1), one shard or tensor per line so that diffs
// and grep stay useful:
//
//   {
//     "format_version": 1,
//     "step": 200,
//     "created": "2024-05-01T12:00:00Z",
//     "writer": "ckptio 0.1.0",
//     "metadata": {...},
//     "shards": [
//       {"name":"shard-00000.safetensors","bytes":4196,"crc32c":"e3069283"}
//     ],
//     "tensors": [
//       {"name":"w","dtype":"F32","shape":[5,5],"shard":"shard-00000.safetensors",
//        "offset":4096,"bytes":100,"crc32c":"0a1b2c3d"}
//     ]
//   }
//
// CRCs are 8 lowercase hex digits (Crc32cToHex): readable, and the same text
// `crc32c`-style tools print. Tensors name their shard in JSON (readable);
// in memory they hold its index. Every field is required; unknown fields are
// refused (a newer writer bumps format_version).
//
// format_version 2 adds chunks: a tensor that is one piece of a larger array
// (a shard of a sharded jax.Array) also carries the array's name, its global
// shape and where the chunk starts in it:
//
//       {"name":"w@16,0","array":"w","global_shape":[64,8],"start":[16,0],
//        "dtype":"F32","shape":[16,8],"shard":...,"offset":...,"bytes":512,"crc32c":"..."}
//
// so a reader finds every byte of any slice of "w" from the manifest alone.
// The chunks of an array tile it exactly (same dtype and global shape, inside
// it, no overlap, no gap). Writers use version 1 when no tensor is a chunk,
// so that older readers still read those checkpoints.
//
// format_version 3 adds incremental saves. A tensor may carry its content
// hash ("xxh3": 32 hex digits, format/content_hash.h), and a shard may be a
// file of an earlier checkpoint of the same root, named by that checkpoint's
// directory and the file ("checkpoint_100/shard-00000.safetensors", both
// parts plain names): the tensors of step N that did not change since step
// 100 point into step 100's shard instead of being written again. Such a
// shard lists the same bytes and CRC32C as in its own checkpoint; the tensors
// placed in it may be a subset of its header's (those that did not change).
// Retention keeps a referenced file until no kept checkpoint refers to it.

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptio/status.h"
#include "ckptio/tensor.h"
#include "base/dtype.h"
#include "format/content_hash.h"
#include "format/safetensors.h"

namespace ckptio::format {

inline constexpr int kManifestFormatVersion = 1;  // whole tensors only
inline constexpr int kChunkedFormatVersion = 2;   // tensors may be chunks of arrays
inline constexpr int kIncrementalFormatVersion = 3;  // content hashes, shards of earlier checkpoints
inline constexpr int kLatestFormatVersion = kIncrementalFormatVersion;
// A manifest lists ~100 bytes per tensor: 256 MiB is millions of tensors.
inline constexpr uint64_t kMaxManifestBytes = uint64_t{256} << 20;
// A shard holds at most one tensor over shard_size (<= base::kMaxTensorBytes) plus
// its header, so twice the tensor limit bounds every honest shard.
inline constexpr uint64_t kMaxShardBytes = uint64_t{1} << 51;

struct ManifestShard {
  std::string name;  // a plain file name in the checkpoint directory
  uint64_t bytes = 0;  // the whole file
  uint32_t crc32c = 0;  // of the whole file
  // format_version 3: the earlier checkpoint (a plain directory / object
  // prefix name under the same root) whose file this is; empty: this one.
  std::string checkpoint = {};

  // How the manifest names it: "shard-00000.safetensors" or
  // "checkpoint_100/shard-00000.safetensors".
  std::string Path() const { return checkpoint.empty() ? name : checkpoint + "/" + name; }
};

struct ManifestTensor {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint32_t shard = 0;   // index into Manifest::shards
  uint64_t offset = 0;  // absolute offset of the data in the shard file
  uint64_t bytes = 0;
  uint32_t crc32c = 0;  // of the tensor's bytes
  ChunkOf chunk = {};   // format_version 2: set when the tensor is a chunk of an array
  std::optional<Hash128> xxh3 = {};  // format_version 3: the content hash, if computed
};

struct Manifest {
  int format_version = kManifestFormatVersion;
  int64_t step = 0;
  std::string created;  // RFC 3339 UTC, e.g. "2024-05-01T12:00:00Z"
  std::string writer;   // e.g. "ckptio 0.1.0"
  nlohmann::json metadata = nlohmann::json::object();  // the user's, an object
  std::vector<ManifestTensor> tensors;
  std::vector<ManifestShard> shards;
};

// The JSON text above. REQUIRES: shard indices valid (ValidateManifest passes);
// strings valid UTF-8 (invalid bytes would be replaced by U+FFFD).
std::string SerializeManifest(const Manifest& manifest);

// The format_version a manifest with these tensors is written as: 2 when one
// is a chunk of an array, else 1.
int FormatVersionFor(const std::vector<ManifestTensor>& tensors);
// The format_version a manifest is written as: 3 when a tensor has a content
// hash or a shard is an earlier checkpoint's, else as above.
int FormatVersionFor(const Manifest& manifest);

// Whether a manifest must hold every chunk of its arrays (a committed
// manifest) or may hold some (one process's fragment of a multi-host save).
enum class Chunks { kComplete, kPartial };

// Parses and validates untrusted manifest bytes (ValidateManifest included).
// Errors are Corruption naming `file` and the field, shard or tensor.
Result<Manifest> ParseManifest(std::string_view file, std::string_view bytes,
                               Chunks chunks = Chunks::kComplete);

// The checks ParseManifest makes beyond JSON types, as Corruption naming
// `file`: names, duplicates, shard indices, sizes against shapes and limits,
// tensors inside their shard and not overlapping, metadata nesting within
// what the parser accepts. A writer should run it on a manifest before
// committing it: a manifest that fails it would be refused by every reader.
Status ValidateManifest(std::string_view file, const Manifest& manifest,
                        Chunks chunks = Chunks::kComplete);

// The chunk checks of ValidateManifest, on tensors alone: each chunk's name,
// rank and box inside its array's global shape; the chunks of one array agree
// on dtype and global shape and do not overlap; no whole tensor has an
// array's name; with kComplete, the chunks of each array cover it. Errors are
// Corruption naming `file`, the array and the chunks.
Status CheckChunks(std::string_view file, const std::vector<ManifestTensor>& tensors, Chunks chunks);

// Checks that the parsed header of shard `shard_index` (a file of file_size
// bytes) agrees with the manifest: same file size, same set of tensors with
// the same dtypes, shapes and absolute offsets (data_start + begin).
// Corruption naming the shard and the tensor; InvalidArgument if shard_index
// is out of range. With `subset` (or a shard of an earlier checkpoint, or its
// copy under this step's name: IsCopyOfEarlierFile), the header may hold
// tensors the manifest does not place in this shard.
// Whether `name` is a file of an earlier step copied under this step's name
// ("<that step>.<file>", e.g. "checkpoint_1.shard-00000.safetensors").
bool IsCopyOfEarlierFile(std::string_view name);

Status CheckShardMatchesManifest(const Manifest& manifest, size_t shard_index,
                                 const SafetensorsHeader& header, uint64_t file_size, bool subset = false);

// "2024-05-01T12:00:00Z" for t (second precision, UTC).
std::string FormatRfc3339Utc(std::chrono::system_clock::time_point t);

// True iff s reads YYYY-MM-DDTHH:MM:SS[.fraction]Z with fields in range.
bool IsRfc3339Utc(std::string_view s);

}  // namespace ckptio::format
