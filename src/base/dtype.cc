#include "base/dtype.h"

#include <array>

#include "base/text.h"

namespace ckptio::base {
namespace {

// A hostile shape may have millions of dimensions; messages show the first few.
constexpr size_t kMaxShownDims = 16;

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 15> kDTypes = {{
    {DType::kBool, "BOOL", 1},   {DType::kU8, "U8", 1},       {DType::kI8, "I8", 1},
    {DType::kU16, "U16", 2},     {DType::kI16, "I16", 2},     {DType::kF16, "F16", 2},
    {DType::kBF16, "BF16", 2},   {DType::kU32, "U32", 4},     {DType::kI32, "I32", 4},
    {DType::kF32, "F32", 4},     {DType::kU64, "U64", 8},     {DType::kI64, "I64", 8},
    {DType::kF64, "F64", 8},     {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
}};

constexpr std::array<DType, kDTypes.size()> MakeAll() {
  std::array<DType, kDTypes.size()> out{};
  for (size_t i = 0; i < kDTypes.size(); ++i) out[i] = kDTypes[i].dtype;
  return out;
}
constexpr std::array<DType, kDTypes.size()> kAllDTypes = MakeAll();

// A DType cast from an unchecked integer (C API, Python) lands here: size 0
// makes TensorBytes refuse it rather than index past kDTypes.
constexpr DTypeInfo kInvalid = {DType::kU8, "INVALID", 0};

const DTypeInfo& Info(DType dtype) {
  // kDTypes is in enum order; the static_asserts below keep it so.
  const auto i = static_cast<size_t>(dtype);
  return i < kDTypes.size() ? kDTypes[i] : kInvalid;
}

constexpr bool InEnumOrder() {
  for (size_t i = 0; i < kDTypes.size(); ++i) {
    if (static_cast<size_t>(kDTypes[i].dtype) != i) return false;
  }
  return true;
}
static_assert(InEnumOrder(), "kDTypes must list the DTypes in declaration order");
static_assert(static_cast<size_t>(DType::kF8E5M2) + 1 == kDTypes.size(),
              "a DType was added: give it a name and a size in kDTypes");

}  // namespace

std::span<const DType> AllDTypes() { return kAllDTypes; }

std::string_view DTypeName(DType dtype) { return Info(dtype).name; }

size_t DTypeSize(DType dtype) { return Info(dtype).size; }

Result<DType> ParseDType(std::string_view name) {
  for (const DTypeInfo& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return InvalidArgumentError("unknown dtype " + Quoted(name));
}

Result<uint64_t> TensorBytes(DType dtype, std::span<const uint64_t> shape) {
  uint64_t nonzero_bytes = DTypeSize(dtype);
  if (nonzero_bytes == 0) {
    return InvalidArgumentError("invalid dtype value " +
                                std::to_string(static_cast<unsigned>(dtype)));
  }
  bool has_zero = false;
  for (uint64_t dim : shape) {
    if (dim == 0) {
      has_zero = true;
      continue;
    }
    // Dividing first keeps the comparison itself from overflowing.
    if (dim > kMaxTensorBytes / nonzero_bytes) {
      return InvalidArgumentError("shape " + ShapeToString(shape) + " x " +
                                  std::string(DTypeName(dtype)) +
                                  " exceeds the 1 PiB (2^50 bytes) tensor limit");
    }
    nonzero_bytes *= dim;
  }
  return has_zero ? 0 : nonzero_bytes;
}

std::string ShapeToString(std::span<const uint64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) out += ", ";
    if (i == kMaxShownDims) {
      out += "... (" + std::to_string(shape.size()) + " dims)";
      break;
    }
    out += std::to_string(shape[i]);
  }
  out += "]";
  return out;
}

}  // namespace ckptio::base
