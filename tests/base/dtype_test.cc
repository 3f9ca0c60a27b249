// DType names and sizes, and TensorBytes on shapes nobody should trust.

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "base/dtype.h"

namespace ckptio::base {
namespace {

using Shape = std::vector<uint64_t>;

TEST_CASE("every dtype has its safetensors name and element size") {
  struct Expected {
    DType dtype;
    std::string_view name;
    size_t size;
  };
  const std::vector<Expected> expected = {
      {DType::kBool, "BOOL", 1}, {DType::kU8, "U8", 1},     {DType::kI8, "I8", 1},
      {DType::kU16, "U16", 2},   {DType::kI16, "I16", 2},   {DType::kF16, "F16", 2},
      {DType::kBF16, "BF16", 2}, {DType::kU32, "U32", 4},   {DType::kI32, "I32", 4},
      {DType::kF32, "F32", 4},   {DType::kU64, "U64", 8},   {DType::kI64, "I64", 8},
      {DType::kF64, "F64", 8},   {DType::kF8E4M3, "F8_E4M3", 1}, {DType::kF8E5M2, "F8_E5M2", 1},
  };
  REQUIRE(AllDTypes().size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i) {
    CAPTURE(expected[i].name);
    CHECK(AllDTypes()[i] == expected[i].dtype);
    CHECK(DTypeName(expected[i].dtype) == expected[i].name);
    CHECK(DTypeSize(expected[i].dtype) == expected[i].size);
  }
}

TEST_CASE("every dtype name parses back to its dtype") {
  for (DType dtype : AllDTypes()) {
    auto parsed = ParseDType(DTypeName(dtype));
    REQUIRE(parsed.ok());
    CHECK(*parsed == dtype);
  }
}

TEST_CASE("an unknown or wrongly cased dtype name is rejected with the name quoted") {
  for (std::string_view bad : {"F31", "f32", "", "F8E4M3", "F32 "}) {
    auto parsed = ParseDType(bad);
    REQUIRE_FALSE(parsed.ok());
    CHECK(parsed.status().code() == StatusCode::kInvalidArgument);
    CHECK(parsed.status().message() == "unknown dtype \"" + std::string(bad) + "\"");
  }
}

TEST_CASE("tensor bytes are the product of the shape times the element size") {
  CHECK(*TensorBytes(DType::kF32, Shape{5, 5}) == 100);
  CHECK(*TensorBytes(DType::kBF16, Shape{3, 7, 2}) == 84);
  CHECK(*TensorBytes(DType::kF64, Shape{1}) == 8);
}

TEST_CASE("a scalar holds one element") {
  CHECK(*TensorBytes(DType::kI64, Shape{}) == 8);
  CHECK(*TensorBytes(DType::kBool, Shape{}) == 1);
}

TEST_CASE("a shape with a zero dimension holds no bytes") {
  CHECK(*TensorBytes(DType::kF32, Shape{0}) == 0);
  CHECK(*TensorBytes(DType::kF32, Shape{7, 0, 3}) == 0);
}

TEST_CASE("a tensor of exactly the byte limit is accepted") {
  CHECK(*TensorBytes(DType::kU8, Shape{kMaxTensorBytes}) == kMaxTensorBytes);
  CHECK(*TensorBytes(DType::kF32, Shape{uint64_t{1} << 24, uint64_t{1} << 24}) == kMaxTensorBytes);
}

TEST_CASE("a tensor one element over the byte limit is rejected") {
  auto bytes = TensorBytes(DType::kU8, Shape{kMaxTensorBytes + 1});
  REQUIRE_FALSE(bytes.ok());
  CHECK(bytes.status().code() == StatusCode::kInvalidArgument);
  CHECK(bytes.status().message() ==
        "shape [1125899906842625] x U8 exceeds the 1 PiB (2^50 bytes) tensor limit");
}

TEST_CASE("a shape whose product overflows 64 bits is rejected, not wrapped") {
  // 2^32 * 2^32 wraps to 0 in uint64_t arithmetic.
  auto bytes = TensorBytes(DType::kU8, Shape{uint64_t{1} << 32, uint64_t{1} << 32});
  REQUIRE_FALSE(bytes.ok());
  CHECK(bytes.status().message().find("exceeds the 1 PiB") != std::string::npos);
  CHECK_FALSE(TensorBytes(DType::kF64, Shape{UINT64_MAX}).ok());
  CHECK_FALSE(TensorBytes(DType::kF64, Shape{UINT64_MAX / 8 + 1}).ok());
}

TEST_CASE("a huge dimension is rejected even beside a zero one") {
  // Zero bytes, but strides computed from it would overflow.
  CHECK_FALSE(TensorBytes(DType::kF32, Shape{0, uint64_t{1} << 62}).ok());
  CHECK_FALSE(TensorBytes(DType::kF32, Shape{uint64_t{1} << 62, 0}).ok());
}

TEST_CASE("a dtype value outside the enum is rejected by TensorBytes") {
  const auto bogus = static_cast<DType>(200);
  CHECK(DTypeSize(bogus) == 0);
  CHECK(DTypeName(bogus) == "INVALID");
  auto bytes = TensorBytes(bogus, Shape{4});
  REQUIRE_FALSE(bytes.ok());
  CHECK(bytes.status().message() == "invalid dtype value 200");
}

TEST_CASE("shapes print as bracketed lists and long ones are cut short") {
  CHECK(ShapeToString(Shape{}) == "[]");
  CHECK(ShapeToString(Shape{5, 5}) == "[5, 5]");
  const Shape long_shape(1000, 1);
  const std::string text = ShapeToString(long_shape);
  CHECK(text.size() < 80);
  CHECK(text.find("(1000 dims)") != std::string::npos);
}

}  // namespace
}  // namespace ckptio::base
