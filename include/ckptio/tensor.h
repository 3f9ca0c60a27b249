#pragma once
// The tensors a trainer hands to ckptio, and the ones it gets back.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ckptio/dtype.h"

namespace ckptio {

// A tensor to save: a dense, C-contiguous buffer the caller owns. In copy
// mode ckptio reads it only during Save(); in borrow mode until the save
// ends (SaveHandle::Wait()).
struct TensorRef {
  std::string name;             // e.g. "params/dense/kernel"; unique within a save
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;  // empty = scalar
  const void* data = nullptr;   // may be null only for a zero-byte tensor
};

// A caller buffer to restore into: must match the saved dtype and shape.
struct MutableTensorRef {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  void* data = nullptr;
};

// A restored tensor that owns its bytes.
struct Tensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<uint64_t> shape;
  std::vector<std::byte> bytes;
};

}  // namespace ckptio
