// The safetensors header: what BuildSafetensorsPrefix writes parses back, and
// every malformed or hostile header is refused with a message that names the
// file and the problem.

#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/status_macros.h"
#include "format/safetensors.h"

namespace ckptio::format {
namespace {

constexpr std::string_view kFile = "shard-00001.safetensors";

// A whole file: prefix, then `data_bytes` bytes of data.
std::string MakeFile(const std::vector<TensorEntry>& tensors,
                     const std::map<std::string, std::string>& metadata = {}, size_t align = 1) {
  uint64_t data_bytes = tensors.empty() ? 0 : tensors.back().end;
  return BuildSafetensorsPrefix(tensors, metadata, align) + std::string(data_bytes, 'd');
}

// A file from a hand-written header, to forge what the builder never writes.
std::string RawFile(std::string_view json, uint64_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (size_t i = 0; i < 8; ++i, n >>= 8) out[i] = static_cast<char>(n & 0xFF);
  out += json;
  out += std::string(data_bytes, 'd');
  return out;
}

// Parses a file the way a reader would: the length, then exactly N header
// bytes copied to their own allocation, so ASan sees any read past them.
Result<SafetensorsHeader> Parse(const std::string& file) {
  std::vector<uint8_t> first8(file.begin(), file.begin() + std::min<size_t>(8, file.size()));
  ASSIGN_OR_RETURN(uint64_t n, ParseHeaderLength(kFile, first8, file.size()));
  std::vector<uint8_t> header(file.begin() + 8, file.begin() + 8 + static_cast<ptrdiff_t>(n));
  return ParseSafetensorsHeader(kFile, header, file.size());
}

// The error message, or "OK".
std::string ErrorOf(const std::string& file) {
  auto parsed = Parse(file);
  if (parsed.ok()) return "OK";
  CHECK(parsed.status().code() == StatusCode::kCorruption);
  return parsed.status().message();
}

bool Contains(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

TensorEntry Entry(std::string name, DType dtype, std::vector<uint64_t> shape, uint64_t begin) {
  TensorEntry e{std::move(name), dtype, std::move(shape), begin, 0};
  uint64_t elements = 1;
  for (uint64_t d : e.shape) elements *= d;
  e.end = begin + elements * base::DTypeSize(dtype);
  return e;
}

// ---- Round trips ----------------------------------------------------------

TEST_CASE("a header with one tensor of every dtype parses back to the same entries") {
  std::vector<TensorEntry> tensors;
  uint64_t offset = 0;
  for (DType dtype : base::AllDTypes()) {
    tensors.push_back(Entry("t_" + std::string(base::DTypeName(dtype)), dtype, {2, 3}, offset));
    offset = tensors.back().end;
  }
  const std::string file = MakeFile(tensors);
  auto header = Parse(file);
  REQUIRE(header.ok());
  REQUIRE(header->tensors.size() == tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    CAPTURE(tensors[i].name);
    CHECK(header->tensors[i].name == tensors[i].name);
    CHECK(header->tensors[i].dtype == tensors[i].dtype);
    CHECK(header->tensors[i].shape == tensors[i].shape);
    CHECK(header->tensors[i].begin == tensors[i].begin);
    CHECK(header->tensors[i].end == tensors[i].end);
  }
  CHECK(header->data_start == file.size() - offset);
  CHECK(header->metadata.empty());
}

TEST_CASE("metadata round-trips as strings") {
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"step", "200"}};
  auto header = Parse(MakeFile({Entry("w", DType::kF32, {2}, 0)}, metadata));
  REQUIRE(header.ok());
  CHECK(header->metadata == metadata);
}

TEST_CASE("the header json has exactly the keys the safetensors spec defines") {
  const std::string prefix =
      BuildSafetensorsPrefix(std::vector{Entry("a.b", DType::kBF16, {3, 1}, 0)}, {{"k", "v"}}, 1);
  const auto json = nlohmann::json::parse(prefix.substr(8));
  CHECK(json == nlohmann::json::parse(
                    R"({"__metadata__":{"k":"v"},)"
                    R"("a.b":{"dtype":"BF16","shape":[3,1],"data_offsets":[0,6]}})"));
  // __metadata__ comes first, as the reference implementation writes it.
  CHECK(prefix.substr(8, 16) == "{\"__metadata__\":");
}

TEST_CASE("the header length is a little-endian u64 of the json size") {
  const std::string prefix = BuildSafetensorsPrefix(std::vector{Entry("w", DType::kU8, {1}, 0)}, {}, 1);
  const uint64_t json_size = prefix.size() - 8;
  for (size_t i = 0; i < 8; ++i) {
    CHECK(static_cast<uint8_t>(prefix[i]) == ((json_size >> (8 * i)) & 0xFF));
  }
  CHECK(prefix[8] == '{');
  CHECK(prefix.back() == '}');
}

TEST_CASE("empty metadata writes no __metadata__ key") {
  const std::string prefix = BuildSafetensorsPrefix(std::vector{Entry("w", DType::kU8, {1}, 0)}, {}, 1);
  CHECK_FALSE(Contains(prefix, "__metadata__"));
}

TEST_CASE("the prefix is padded with spaces to the alignment") {
  const std::vector tensors = {Entry("w", DType::kF32, {5, 5}, 0)};
  const std::string prefix = BuildSafetensorsPrefix(tensors, {}, 4096);
  CHECK(prefix.size() == 4096);
  const size_t json_end = prefix.rfind('}');
  CHECK(prefix.find_first_not_of(' ', json_end + 1) == std::string::npos);
  auto header = Parse(prefix + std::string(100, 'd'));
  REQUIRE(header.ok());
  CHECK(header->data_start == 4096);
}

TEST_CASE("a header already at the alignment gets no padding") {
  const std::vector tensors = {Entry("w", DType::kF32, {5, 5}, 0)};
  const size_t unpadded = BuildSafetensorsPrefix(tensors, {}, 1).size();
  CHECK(BuildSafetensorsPrefix(tensors, {}, unpadded).size() == unpadded);
  CHECK(BuildSafetensorsPrefix(tensors, {}, 0).size() == unpadded);
}

TEST_CASE("parsed tensors are sorted by offset whatever the key order") {
  // Keys sort z, a, m by name; the data order is z, a, m by offset.
  const std::string file = RawFile(
      R"({"m":{"dtype":"U8","shape":[3],"data_offsets":[3,6]},)"
      R"("z":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
      R"("a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}})",
      6);
  auto header = Parse(file);
  REQUIRE(header.ok());
  REQUIRE(header->tensors.size() == 3);
  CHECK(header->tensors[0].name == "z");
  CHECK(header->tensors[1].name == "a");
  CHECK(header->tensors[2].name == "m");
}

TEST_CASE("zero-byte and scalar tensors parse") {
  auto header = Parse(MakeFile({Entry("empty", DType::kF32, {0, 4}, 0), Entry("scalar", DType::kI64, {}, 0)}));
  REQUIRE(header.ok());
  REQUIRE(header->tensors.size() == 2);
  CHECK(header->tensors[0].name == "empty");
  CHECK(header->tensors[0].end == 0);
  CHECK(header->tensors[1].shape.empty());
  CHECK(header->tensors[1].end == 8);
}

TEST_CASE("a header with no tensors and no data is valid") {
  auto header = Parse(RawFile("{}", 0));
  REQUIRE(header.ok());
  CHECK(header->tensors.empty());
  CHECK(header->data_start == 10);
}

// ---- The header length ----------------------------------------------------

TEST_CASE("a file too short for the header length is refused") {
  CHECK(ErrorOf("1234") ==
        "shard-00001.safetensors: file of 4 bytes is too short to hold the 8-byte header length");
}

TEST_CASE("a header length past the end of the file is refused") {
  std::string file = RawFile("{}", 0);
  file[0] = 11;
  CHECK(ErrorOf(file) ==
        "shard-00001.safetensors: header length 11 runs past the end of the file (10 bytes)");
}

TEST_CASE("an absurd header length is refused before anything is read") {
  std::string file = RawFile("{}", 0);
  file[7] = '\x80';  // 2^63 + 2
  CHECK(ErrorOf(file) == "shard-00001.safetensors: header length 9223372036854775810 exceeds the "
                         "100000000-byte header limit");
  const std::vector<uint8_t> just_over = {0x01, 0xE1, 0xF5, 0x05, 0, 0, 0, 0};  // 100000001
  auto n = ParseHeaderLength(kFile, just_over, uint64_t{1} << 40);
  REQUIRE_FALSE(n.ok());
  CHECK(n.status().message() == "shard-00001.safetensors: header length 100000001 exceeds the "
                                "100000000-byte header limit");
}

TEST_CASE("header bytes that do not fit the file size are refused") {
  const std::vector<uint8_t> json = {'{', '}'};
  auto header = ParseSafetensorsHeader(kFile, json, 9);
  REQUIRE_FALSE(header.ok());
  CHECK(Contains(header.status().message(), "shard-00001.safetensors: header of 2 bytes does not fit"));
}

// ---- Hostile headers ------------------------------------------------------

TEST_CASE("a header that is not json is refused") {
  const std::string error = ErrorOf(RawFile("{\"w\": nope}", 0));
  CHECK(Contains(error, "shard-00001.safetensors: header is not valid JSON: parse error"));
}

TEST_CASE("a header that is json but not an object is refused") {
  CHECK(ErrorOf(RawFile("[1, 2]", 0)) == "shard-00001.safetensors: header is not a JSON object");
}

TEST_CASE("a header with invalid utf-8 is refused") {
  CHECK(Contains(ErrorOf(RawFile("{\"w\xff\":{}}", 0)),
                 "shard-00001.safetensors: header is not valid JSON"));
}

TEST_CASE("a tensor entry that is not an object is refused") {
  CHECK(ErrorOf(RawFile(R"({"w":[1]})", 0)) ==
        "shard-00001.safetensors: tensor \"w\": entry is not a JSON object");
}

TEST_CASE("a tensor entry missing a field is refused naming the field") {
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":[1]}})", 1)) ==
        "shard-00001.safetensors: tensor \"w\": missing field \"data_offsets\"");
}

TEST_CASE("a tensor entry with a wrongly typed field is refused naming the field") {
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":7,"shape":[1],"data_offsets":[0,1]}})", 1)) ==
        "shard-00001.safetensors: tensor \"w\": field \"dtype\" must be a string");
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":"1","data_offsets":[0,1]}})", 1)) ==
        "shard-00001.safetensors: tensor \"w\": field \"shape\" must be an array of unsigned "
        "integers");
}

TEST_CASE("negative and fractional numbers are refused where sizes belong") {
  CHECK(Contains(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1)),
                 "field \"shape\" must be an array of unsigned integers"));
  CHECK(Contains(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}})", 1)),
                 "field \"data_offsets\" must be an array of unsigned integers"));
  CHECK(Contains(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":[1e30],"data_offsets":[0,1]}})", 1)),
                 "field \"shape\" must be an array of unsigned integers"));
}

TEST_CASE("data_offsets that are not a pair are refused") {
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1,2]}})", 1)) ==
        "shard-00001.safetensors: tensor \"w\": field \"data_offsets\" must be [begin, end]");
}

TEST_CASE("an unknown field in a tensor entry is refused") {
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":1}})", 1)) ==
        "shard-00001.safetensors: tensor \"w\": unknown field \"x\"");
}

TEST_CASE("an unknown dtype is refused") {
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})", 4)) ==
        "shard-00001.safetensors: tensor \"w\": unknown dtype \"F31\"");
}

TEST_CASE("offsets past the end of the data section are refused") {
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}})", 7)) ==
        "shard-00001.safetensors: tensor \"w\": data_offsets [0, 8] run past the end of the "
        "data section (7 bytes)");
}

TEST_CASE("offsets with begin after end are refused") {
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[5,4]}})", 5)) ==
        "shard-00001.safetensors: tensor \"w\": data_offsets [5, 4] have begin after end");
}

TEST_CASE("offsets that disagree with shape times dtype size are refused") {
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":"F32","shape":[5,5],"data_offsets":[0,99]}})", 99)) ==
        "shard-00001.safetensors: tensor \"w\": data_offsets [0, 99] do not match shape "
        "[5, 5] x F32 = 100 bytes");
}

TEST_CASE("a shape whose byte count overflows is refused") {
  // 2^32 * 2^32 * 4 wraps to 0, which would match data_offsets [0, 0].
  CHECK(ErrorOf(RawFile(
            R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0)) ==
        "shard-00001.safetensors: tensor \"w\": shape [4294967296, 4294967296] x F32 exceeds the "
        "1 PiB (2^50 bytes) tensor limit");
}

TEST_CASE("overlapping tensors are refused") {
  CHECK(ErrorOf(RawFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                        6)) == "shard-00001.safetensors: tensors \"a\" [0, 4] and \"b\" [2, 6] overlap");
}

TEST_CASE("two tensors on the same bytes are refused") {
  CHECK(Contains(ErrorOf(RawFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                                 R"("b":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})",
                                 4)),
                 "overlap"));
}

TEST_CASE("a hole between tensors is refused") {
  CHECK(ErrorOf(RawFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
                        10)) ==
        "shard-00001.safetensors: hole of 2 bytes before tensor \"b\" [6, 10] (safetensors "
        "requires contiguous tensors)");
}

TEST_CASE("a hole before the first tensor is refused") {
  CHECK(Contains(ErrorOf(RawFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[1,5]}})", 5)),
                 "hole of 1 bytes before tensor \"a\""));
}

TEST_CASE("bytes after the last tensor are refused") {
  CHECK(ErrorOf(RawFile(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 6)) ==
        "shard-00001.safetensors: 2 bytes of data after the last tensor (the data section is 6 "
        "bytes, tensors cover 4)");
}

TEST_CASE("hostile tensor names are refused") {
  const auto error_for_name = [](std::string_view quoted_name) {
    return ErrorOf(RawFile(
        "{" + std::string(quoted_name) + R"(:{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1));
  };
  CHECK(error_for_name(R"("")") == "shard-00001.safetensors: tensor name is empty");
  CHECK(error_for_name(R"("/etc/passwd")") ==
        "shard-00001.safetensors: tensor name \"/etc/passwd\" is an absolute path");
  CHECK(error_for_name(R"("a/../../b")") ==
        "shard-00001.safetensors: tensor name \"a/../../b\" contains a \"..\" path component");
  CHECK(error_for_name(R"("..")") ==
        "shard-00001.safetensors: tensor name \"..\" contains a \"..\" path component");
  CHECK(error_for_name(R"("a\u0000b")") ==
        "shard-00001.safetensors: tensor name \"a\\u0000b\" contains a NUL byte");
}

TEST_CASE("names that only look like dot-dot are allowed") {
  auto header = Parse(RawFile(R"({"a..b/..c/...":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1));
  REQUIRE(header.ok());
  CHECK(header->tensors[0].name == "a..b/..c/...");
}

TEST_CASE("a tensor name repeated in the header is refused") {
  // nlohmann would otherwise keep one of the two silently.
  CHECK(ErrorOf(RawFile(R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                        R"("w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                        2)) == "shard-00001.safetensors: header has the key \"w\" twice in one object");
}

TEST_CASE("a field repeated inside a tensor entry is refused") {
  CHECK(Contains(ErrorOf(RawFile(R"({"w":{"dtype":"U8","dtype":"F64","shape":[1],"data_offsets":[0,1]}})", 1)),
                 "has the key \"dtype\" twice"));
}

TEST_CASE("metadata with a non-string value is refused") {
  CHECK(ErrorOf(RawFile(R"({"__metadata__":{"step":200}})", 0)) ==
        "shard-00001.safetensors: __metadata__: value of \"step\" is not a string");
  CHECK(ErrorOf(RawFile(R"({"__metadata__":"x"})", 0)) ==
        "shard-00001.safetensors: __metadata__ is not a JSON object");
}

TEST_CASE("deeply nested json is refused before it costs memory") {
  const std::string deep = "{\"__metadata__\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  CHECK(ErrorOf(RawFile(deep, 0)) == "shard-00001.safetensors: header nests deeper than 64 levels");
}

TEST_CASE("a control character in a hostile name cannot forge a log line") {
  const std::string error =
      ErrorOf(RawFile(R"({"/x\nERROR fake":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1));
  CHECK(error == "shard-00001.safetensors: tensor name \"/x\\nERROR fake\" is an absolute path");
}

TEST_CASE("every truncation of a valid header is refused") {
  const std::string json(
      R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},)"
      R"("b":{"dtype":"I8","shape":[],"data_offsets":[16,17]}})");
  REQUIRE(Parse(RawFile(json, 17)).ok());
  for (size_t n = 0; n < json.size(); ++n) {
    CAPTURE(n);
    auto header = ParseSafetensorsHeader(
        kFile, std::vector<uint8_t>(json.begin(), json.begin() + static_cast<ptrdiff_t>(n)),
        8 + n + 17);
    REQUIRE_FALSE(header.ok());
    CHECK(header.status().message().starts_with("shard-00001.safetensors: "));
  }
}

TEST_CASE("random corruption of a valid file never escapes as anything but an error") {
  std::vector<TensorEntry> tensors = {Entry("a", DType::kF32, {3, 3}, 0),
                                      Entry("b/c", DType::kBF16, {2}, 36),
                                      Entry("d", DType::kF8E4M3, {0}, 40)};
  const std::string good = MakeFile(tensors, {{"k", "v"}});
  std::mt19937_64 rng(42);
  int refused = 0;
  for (int round = 0; round < 3000; ++round) {
    std::string file = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) file[rng() % file.size()] = static_cast<char>(rng());
    auto header = Parse(file);
    if (!header.ok()) {
      ++refused;
      CHECK(header.status().code() == StatusCode::kCorruption);
      CHECK(header.status().message().starts_with("shard-00001.safetensors: "));
    }
  }
  CHECK(refused > 0);
}

}  // namespace
}  // namespace ckptio::format
