#pragma once
// The safetensors file format, as ckptio writes and reads its shards:
//
//   [8 bytes: N, little-endian u64][N bytes: JSON header][data section]
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end]} with offsets relative to the data section (which starts at
// 8 + N), plus an optional "__metadata__": {string: string}. Tensors must
// tile the data section exactly: no overlaps, no holes, nothing after the
// last one. ckptio pads the header with spaces (which JSON ignores) so the
// data starts block-aligned, for O_DIRECT.
//
// Everything here is pure and synchronous. The parsers treat every byte as
// hostile: each error is a Corruption naming the file and what is wrong.

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/status.h"
#include "base/dtype.h"

namespace ckptio::format {

// The reference implementation (huggingface/safetensors) refuses larger
// headers, so ckptio neither writes nor reads them. Decimal, as it is there.
inline constexpr uint64_t kMaxHeaderBytes = 100'000'000;

struct TensorEntry {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t begin = 0;  // relative to the start of the data section
  uint64_t end = 0;
};

struct SafetensorsHeader {
  std::vector<TensorEntry> tensors;  // sorted by begin
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // 8 + N
};

// Reads N from the first 8 bytes of a file of file_size bytes. Corruption if
// fewer than 8 bytes, if N > kMaxHeaderBytes, or if 8 + N > file_size.
// `file` names the file in error messages only.
Result<uint64_t> ParseHeaderLength(std::string_view file, std::span<const uint8_t> first8,
                                   uint64_t file_size);

// Parses and validates the N header bytes (header_json.size() == N) of a file
// of file_size bytes: types, dtypes, names, shapes against offsets, offsets
// against the file size, and the exact tiling of the data section. Never
// reads outside header_json.
Result<SafetensorsHeader> ParseSafetensorsHeader(std::string_view file,
                                                 std::span<const uint8_t> header_json,
                                                 uint64_t file_size);

// The 8-byte length and the JSON header, padded with trailing spaces so that
// the result's size is a multiple of `align` (0 or 1: no padding). Keys are
// "__metadata__" (only if metadata is non-empty), then the tensors in the
// given order.
// REQUIRES: tensors tile [0, data bytes) in order with valid, unique names
// (as PlanShards produces); strings are valid UTF-8 (invalid bytes would be
// replaced by U+FFFD).
// With `residue`, the data starts `residue` bytes past that multiple of align.
std::string BuildSafetensorsPrefix(std::span<const TensorEntry> tensors,
                                   const std::map<std::string, std::string>& metadata,
                                   size_t align, size_t residue = 0);

// ---- Shard planning -------------------------------------------------------

struct TensorSpec {
  std::string name;
  DType dtype = DType::kU8;
  std::vector<uint64_t> shape;
  uint64_t bytes = 0;
};

struct PlannedTensor {
  size_t index = 0;     // into the specs given to PlanShards
  uint64_t offset = 0;  // absolute file offset of its data
  uint64_t bytes = 0;
};

struct PlannedShard {
  std::string name;    // e.g. "shard-00000.safetensors"
  std::string prefix;  // BuildSafetensorsPrefix output: the file's first bytes
  std::vector<PlannedTensor> tensors;  // in data order
  uint64_t file_size = 0;  // prefix.size() + data bytes
};

// Where the tensors' bytes sit in memory, for a writer that sends them to
// the file without copying them where the file offset agrees with the memory
// address modulo `modulus` (O_DIRECT needs memory and file offsets aligned
// alike; safetensors allows no holes between tensors to make them agree).
struct MemoryResidues {
  std::span<const uint32_t> residue;  // per spec: its address modulo `modulus`
  uint32_t modulus = 0;               // a power of two dividing align; 0: none
};

// Lays tensors out into shard files: in input order, each shard holding at
// most shard_size bytes of data, except that a tensor larger than shard_size
// gets a shard of its own. Zero-byte and scalar tensors are fine. Every shard's
// data starts at a multiple of align (align >= 1). Shards are named
// name_prefix + 5-digit index + ".safetensors". No specs, no shards.
// With `residues`, tensors are grouped by residue instead (stable; within a
// group the ones whose size is a multiple of the modulus first, so that they
// keep the next one's residue), a shard holds one group, and its data starts
// at its first tensor's residue past a multiple of align: every tensor whose
// predecessors in the shard are multiples of the modulus has a file offset
// that agrees with its address.
// InvalidArgument for an invalid or duplicate name, bytes != shape x dtype
// size, shard_size outside [1, base::kMaxTensorBytes], align outside [1, 1 MiB], a
// name_prefix that does not make plain file names, residues that do not
// match the specs or the alignment, or a shard header over kMaxHeaderBytes.
Result<std::vector<PlannedShard>> PlanShards(std::span<const TensorSpec> specs,
                                             uint64_t shard_size, size_t align,
                                             std::string_view name_prefix = "shard-",
                                             MemoryResidues residues = {});

}  // namespace ckptio::format
