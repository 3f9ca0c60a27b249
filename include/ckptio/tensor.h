#pragma once
// The tensors a trainer hands to ckptio, and the ones it gets back.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "ckptio/dtype.h"

namespace ckptio {

// Where a tensor sits when it is one chunk of a larger array (a shard of a
// sharded jax.Array): the array's name and global shape, and the chunk's
// first index on each axis (its extent is the tensor's shape). The chunks of
// one array, from every process of a save, must tile it exactly: no gap, no
// overlap. An empty `array` means the tensor is a whole array of its own.
// A chunk's tensor name is ChunkName(array, start): "params/w@0,128".
struct ChunkOf {
  std::string array;
  std::vector<uint64_t> global_shape;
  std::vector<uint64_t> start;

  bool empty() const { return array.empty(); }
};

// "params/w@0,128": the tensor name of the chunk of `array` starting at `start`.
inline std::string ChunkName(const std::string& array, const std::vector<uint64_t>& start) {
  std::string name = array + "@";
  for (size_t i = 0; i < start.size(); ++i) name += (i ? "," : "") + std::to_string(start[i]);
  return name;
}

// A tensor to save: a dense, C-contiguous buffer the caller owns. In copy
// mode ckptio reads it only during Save(); in borrow mode until the save
// ends (SaveHandle::Wait()).
struct TensorRef {
  std::string name;             // e.g. "params/dense/kernel"; unique within a save
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;  // empty = scalar
  const void* data = nullptr;   // may be null only for a zero-byte tensor
  ChunkOf chunk = {};           // set when the tensor is one chunk of a larger array
  // Two tiers in a multi-host job only: a copy of a tensor (or chunk) that
  // another process saves, kept in this host's local tier alone so that a
  // restore here reads it from the local disk (a replicated array's part
  // another process writes, a scalar process 0 writes). Never sent to the
  // remote tier, never part of the checkpoint's manifest.
  bool local_copy = false;
};

// A caller buffer to restore into: must match the saved dtype and shape.
struct MutableTensorRef {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  void* data = nullptr;
};

// A byte range of a saved tensor's (row-major) data to restore into a caller
// buffer of `length` bytes: e.g. the rows a process needs of a tensor that
// another process saved whole. With rows > 1, that many ranges of `length`
// bytes: row i from offset + i * stride of the tensor's data to
// data + i * dst_stride (e.g. the columns [c0, c1) of an R x C float32 matrix
// into an R x (c1 - c0) buffer: offset 4 * c0, length 4 * (c1 - c0), rows R,
// stride 4 * C, dst_stride 4 * (c1 - c0)). The rows of all the slices of a
// tensor are read together, once, straight into place.
struct TensorSlice {
  std::string name;
  uint64_t offset = 0;  // bytes into the tensor's data
  uint64_t length = 0;  // of each row
  void* data = nullptr;
  uint64_t rows = 1;
  uint64_t stride = 0;      // with rows > 1: at least length
  uint64_t dst_stride = 0;  // with rows > 1: at least length
};

// An allocator whose value-less construct() leaves memory uninitialized, so
// a Bytes buffer sized for a restore is not zero-filled first (the read
// overwrites every byte: zeroing would be one more pass over the checkpoint).
// Buffers of kPageAlignFrom bytes or more start on a page: a restore reads
// into them around the page cache (O_DIRECT wants aligned memory), and
// numpy or jax can take them as they are (jax aliases host memory it is
// handed only if it is aligned; otherwise device_put copies it).
template <typename T>
struct NoInitAllocator : std::allocator<T> {
  static constexpr size_t kPageAlignFrom = size_t{64} << 10;
  static constexpr std::align_val_t kPage{4096};
  template <typename U>
  struct rebind {
    using other = NoInitAllocator<U>;
  };
  NoInitAllocator() = default;
  template <typename U>
  NoInitAllocator(const NoInitAllocator<U>&) noexcept {}  // NOLINT: rebinding
  T* allocate(size_t n) {
    if (n > std::numeric_limits<size_t>::max() / sizeof(T)) throw std::bad_array_new_length();
    const size_t bytes = n * sizeof(T);
    if (bytes >= kPageAlignFrom) return static_cast<T*>(::operator new(bytes, kPage));
    return std::allocator<T>::allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n * sizeof(T) >= kPageAlignFrom) {
      ::operator delete(p, kPage);
    } else {
      std::allocator<T>::deallocate(p, n);
    }
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    if constexpr (sizeof...(Args) == 0) {
      ::new (static_cast<void*>(p)) U;
    } else {
      ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
  }
};
using Bytes = std::vector<std::byte, NoInitAllocator<std::byte>>;

// A restored tensor that owns its bytes.
struct Tensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  Bytes bytes;
  ChunkOf chunk = {};  // set when the tensor is one chunk of a larger array
};

}  // namespace ckptio
