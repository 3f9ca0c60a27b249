#pragma once
// Element types of tensors, spelled as safetensors spells them, and the byte
// size of a tensor computed without trusting its shape.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "ckptio/dtype.h"
#include "ckptio/status.h"

namespace ckptio::base {

// The public enum (include/ckptio/dtype.h): callers hand tensors to ckptio
// with it, and the format layer must not have a second, convertible-by-cast
// copy of it.
using ::ckptio::DType;

// Every DType, in declaration order (for tests and for listing).
std::span<const DType> AllDTypes();

// No tensor may exceed 1 PiB: far past any real one, and low enough that sums
// of a few sizes and offsets cannot overflow 64 bits.
inline constexpr uint64_t kMaxTensorBytes = uint64_t{1} << 50;

// The safetensors spelling: "F32", "BF16", "F8_E4M3", ... ("INVALID" and size
// 0 for a value outside the enum).
std::string_view DTypeName(DType dtype);

// The inverse of DTypeName (exact, case-sensitive). InvalidArgument
// `unknown dtype "F31"` otherwise.
Result<DType> ParseDType(std::string_view name);

// Bytes per element.
size_t DTypeSize(DType dtype);

// Bytes of a dense tensor: product(shape) * DTypeSize(dtype); a scalar (empty
// shape) has one element. InvalidArgument if the product overflows or exceeds
// kMaxTensorBytes. Zero dimensions are left out of the check: a [0, 2^62]
// tensor holds 0 bytes but a reader computing its strides would overflow, so
// it is refused like [1, 2^62].
Result<uint64_t> TensorBytes(DType dtype, std::span<const uint64_t> shape);

// "[5, 5]", for error messages.
std::string ShapeToString(std::span<const uint64_t> shape);

}  // namespace ckptio::base
