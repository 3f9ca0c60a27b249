#pragma once
// DirectPlan: how a file image goes out with O_DIRECT when some of its bytes
// are not block-aligned in memory.
//
// O_DIRECT needs the file offset and the length of each write aligned to the
// block (4 KiB here), and the memory address to the file system's memory
// alignment (`mem_align`: 512 bytes on most block devices, at most the
// block; statx STATX_DIOALIGN says). Staged shards always are; borrowed
// tensors are not, once a tensor whose size is not a whole number of blocks
// shifts the file offsets of the ones after it (safetensors packs tensors
// without holes). Rather than writing such a file through the page cache,
// the plan cuts it into block-aligned writes of at most `max_len` bytes:
// "direct" ones straight from a segment, wherever a run of whole blocks of
// one segment sits at a memory address that agrees with its file offset
// modulo mem_align, and "gathered" ones for the rest, whose bytes the writer
// copies into an aligned bounce buffer (Gather) before writing it.
//
// The last write is padded up to a block (zeros, or a segment's capacity);
// the writer truncates the file to its size afterwards.
// Not thread-safe; the image's segments must outlive the plan.

#include <cstddef>
#include <cstdint>

#include "storage/storage.h"

namespace ckptio::storage {

inline constexpr size_t kDirectBlock = 4096;

// One write: [offset, offset + len) of the file, both multiples of the block.
struct DirectWrite {
  uint64_t offset = 0;
  size_t len = 0;
  const char* data = nullptr;  // block-aligned source, or null: gather it
};

class DirectPlan {
 public:
  // REQUIRES: the image's segments are in order and cover [0, size) without
  // gaps; max_len is a positive multiple of the block; mem_align a power of
  // two dividing the block.
  DirectPlan(const FileImage* image, size_t max_len, size_t mem_align = kDirectBlock);

  bool done() const { return pos_ >= end_; }
  // The next write, in file order; with `direct` false, a gathered one.
  // REQUIRES: !done().
  DirectWrite Next(bool direct = true);
  // Copies the image's bytes of `w` into dst (w.len bytes, zeros past the end
  // of the file). Thread-safe against Next() (reads only the segments).
  void Gather(const DirectWrite& w, char* dst) const;

 private:
  // Index of the segment holding file offset `pos`, searched from `from`.
  size_t SegmentAt(uint64_t pos, size_t from) const;
  // Whether the block at `pos` can be written from segment `i`'s memory.
  bool DirectAt(uint64_t pos, size_t i) const;
  // Where a direct run from segment `i` must end (exclusive).
  uint64_t DirectEnd(size_t i) const;

  const FileImage* image_;
  size_t max_len_;
  size_t mem_align_;
  uint64_t end_;      // the file size rounded up to a block
  uint64_t pos_ = 0;  // next byte to plan
  size_t seg_ = 0;    // the segment holding pos_
};

}  // namespace ckptio::storage
