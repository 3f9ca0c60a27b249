#pragma once
// Element types of tensors, as safetensors names them.

#include <cstdint>

namespace ckptio {

enum class DType : uint8_t {
  kBool, kU8, kI8, kU16, kI16, kF16, kBF16, kU32, kI32, kF32, kU64, kI64, kF64,
  kF8E4M3, kF8E5M2,
};

}  // namespace ckptio
