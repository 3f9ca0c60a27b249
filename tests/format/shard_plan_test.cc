// PlanShards: how tensors are packed into shard files, and that every planned
// prefix is a safetensors header describing exactly the planned layout.

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "format/safetensors.h"

namespace ckptio::format {
namespace {

TensorSpec U8(std::string name, uint64_t bytes) {
  return {std::move(name), DType::kU8, {bytes}, bytes};
}

// The spec indices of each planned shard.
std::vector<std::vector<size_t>> Layout(const std::vector<PlannedShard>& shards) {
  std::vector<std::vector<size_t>> out;
  for (const PlannedShard& s : shards) {
    out.emplace_back();
    for (const PlannedTensor& t : s.tensors) out.back().push_back(t.index);
  }
  return out;
}

using Groups = std::vector<std::vector<size_t>>;

TEST_CASE("tensors are packed in input order into shards of at most shard_size data bytes") {
  const std::vector specs = {U8("a", 40), U8("b", 40), U8("c", 40), U8("d", 10), U8("e", 60)};
  auto shards = PlanShards(specs, 100, 1);
  REQUIRE(shards.ok());
  CHECK(Layout(*shards) == Groups{{0, 1}, {2, 3}, {4}});
}

TEST_CASE("tensors filling a shard exactly share it") {
  auto shards = PlanShards(std::vector{U8("a", 50), U8("b", 50), U8("c", 1)}, 100, 1);
  REQUIRE(shards.ok());
  CHECK(Layout(*shards) == Groups{{0, 1}, {2}});
}

TEST_CASE("a tensor larger than shard_size gets a shard of its own") {
  auto shards = PlanShards(std::vector{U8("a", 10), U8("big", 500), U8("c", 10)}, 100, 1);
  REQUIRE(shards.ok());
  CHECK(Layout(*shards) == Groups{{0}, {1}, {2}});
  CHECK((*shards)[1].file_size == (*shards)[1].prefix.size() + 500);
}

TEST_CASE("zero-byte and scalar tensors are planned like any other") {
  const std::vector<TensorSpec> specs = {
      {"empty", DType::kF32, {0, 3}, 0}, {"scalar", DType::kF64, {}, 8}, {"empty2", DType::kI8, {0}, 0}};
  auto shards = PlanShards(specs, 8, 1);
  REQUIRE(shards.ok());
  CHECK(Layout(*shards) == Groups{{0, 1, 2}});
  const PlannedShard& s = (*shards)[0];
  CHECK(s.tensors[0].offset == s.prefix.size());
  CHECK(s.tensors[1].offset == s.prefix.size());
  CHECK(s.tensors[1].bytes == 8);
  CHECK(s.tensors[2].offset == s.prefix.size() + 8);
  CHECK(s.file_size == s.prefix.size() + 8);
}

TEST_CASE("no tensors plan no shards") {
  auto shards = PlanShards({}, 100, 4096);
  REQUIRE(shards.ok());
  CHECK(shards->empty());
}

TEST_CASE("each shard's data starts at a multiple of the alignment and tensors follow contiguously") {
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 50; ++i) specs.push_back({"layer" + std::to_string(i), DType::kF32, {7, 11}, 308});
  auto shards = PlanShards(specs, 1000, 4096);
  REQUIRE(shards.ok());
  REQUIRE(shards->size() == 17);  // three 308-byte tensors per 1000-byte shard
  for (const PlannedShard& s : *shards) {
    CHECK(s.prefix.size() % 4096 == 0);
    uint64_t expected = s.prefix.size();
    for (const PlannedTensor& t : s.tensors) {
      CHECK(t.offset == expected);
      CHECK(t.bytes == 308);
      expected += t.bytes;
    }
    CHECK(s.file_size == expected);
  }
}

TEST_CASE("shards are named with a five-digit index") {
  auto shards = PlanShards(std::vector{U8("a", 2), U8("b", 2), U8("c", 2)}, 2, 1);
  REQUIRE(shards.ok());
  REQUIRE(shards->size() == 3);
  CHECK((*shards)[0].name == "shard-00000.safetensors");
  CHECK((*shards)[1].name == "shard-00001.safetensors");
  CHECK((*shards)[2].name == "shard-00002.safetensors");
}

TEST_CASE("a custom name prefix is used for every shard") {
  auto shards = PlanShards(std::vector{U8("a", 2)}, 2, 1, "opt_state-");
  REQUIRE(shards.ok());
  CHECK((*shards)[0].name == "opt_state-00000.safetensors");
}

TEST_CASE("every planned prefix parses back to the planned tensors") {
  const std::vector<TensorSpec> specs = {{"params/w", DType::kBF16, {64, 32}, 4096},
                                         {"params/b", DType::kF32, {32}, 128},
                                         {"step", DType::kI64, {}, 8},
                                         {"mask", DType::kBool, {0}, 0},
                                         {"scale", DType::kF8E5M2, {100}, 100}};
  auto shards = PlanShards(specs, 4096, 4096);
  REQUIRE(shards.ok());
  size_t seen = 0;
  for (const PlannedShard& s : *shards) {
    CAPTURE(s.name);
    std::vector<uint8_t> json(s.prefix.begin() + 8, s.prefix.end());
    auto header = ParseSafetensorsHeader(s.name, json, s.file_size);
    REQUIRE(header.ok());
    CHECK(header->data_start == s.prefix.size());
    REQUIRE(header->tensors.size() == s.tensors.size());
    for (size_t i = 0; i < s.tensors.size(); ++i) {
      const TensorSpec& spec = specs[s.tensors[i].index];
      const TensorEntry& e = header->tensors[i];
      CHECK(e.name == spec.name);
      CHECK(e.dtype == spec.dtype);
      CHECK(e.shape == spec.shape);
      CHECK(header->data_start + e.begin == s.tensors[i].offset);
      CHECK(e.end - e.begin == spec.bytes);
      ++seen;
    }
  }
  CHECK(seen == specs.size());
}

TEST_CASE("with memory residues, tensors are grouped by residue and each lands at a file offset that agrees") {
  // Addresses modulo 512 as a jax state gives them (64-byte-aligned); sizes
  // in whole 512 B units except "odd", which goes last in its group.
  const std::vector specs = {U8("a", 4096), U8("odd", 1000), U8("b", 8192), U8("c", 4096), U8("d", 1024),
                             U8("e", 4096)};
  const std::vector<uint32_t> residue = {64, 64, 448, 64, 0, 448};
  auto shards = PlanShards(specs, 1 << 20, 4096, "shard-", {residue, 512});
  REQUIRE(shards.ok());
  // Groups in residue order (0, 64, 448), input order within a group except
  // that the odd-sized tensor follows the whole ones.
  CHECK(Layout(*shards) == Groups{{4}, {0, 3, 1}, {2, 5}});
  for (const PlannedShard& s : *shards) {
    CAPTURE(s.name);
    for (const PlannedTensor& t : s.tensors) {
      CAPTURE(specs[t.index].name);
      CHECK(t.offset % 512 == residue[t.index]);
      CHECK(t.offset >= 4096);  // past the header's block
    }
    std::vector<uint8_t> json(s.prefix.begin() + 8, s.prefix.end());
    auto header = ParseSafetensorsHeader(s.name, json, s.file_size);
    REQUIRE(header.ok());
    CHECK(header->data_start == s.prefix.size());
    CHECK(header->data_start % 4096 == residue[s.tensors.front().index]);
  }
  // A shard still holds at most shard_size bytes.
  auto small = PlanShards(specs, 8192, 4096, "shard-", {residue, 512});
  REQUIRE(small.ok());
  CHECK(Layout(*small) == Groups{{4}, {0, 3}, {1}, {2}, {5}});
}

TEST_CASE("memory residues that do not fit the specs or the alignment are refused") {
  const std::vector specs = {U8("a", 10), U8("b", 10)};
  const std::vector<uint32_t> two = {0, 64}, one = {0}, big = {0, 512};
  CHECK(!PlanShards(specs, 100, 4096, "shard-", {one, 512}).ok());
  CHECK(!PlanShards(specs, 100, 4096, "shard-", {big, 512}).ok());
  CHECK(!PlanShards(specs, 100, 4096, "shard-", {two, 384}).ok());   // not a power of two
  CHECK(!PlanShards(specs, 100, 256, "shard-", {two, 512}).ok());    // does not divide the alignment
  auto ok = PlanShards(specs, 100, 4096, "shard-", {two, 512});
  REQUIRE(ok.ok());
  CHECK(Layout(*ok) == Groups{{0}, {1}});
}

TEST_CASE("a spec whose bytes disagree with its shape is refused") {
  const std::vector<TensorSpec> specs = {{"w", DType::kF32, {5, 5}, 99}};
  auto shards = PlanShards(specs, 100, 1);
  REQUIRE_FALSE(shards.ok());
  CHECK(shards.status().code() == StatusCode::kInvalidArgument);
  CHECK(shards.status().message() == "tensor \"w\": bytes 99 do not match shape [5, 5] x F32 = 100 bytes");
}

TEST_CASE("a spec over the tensor size limit is refused") {
  const std::vector<TensorSpec> specs = {{"w", DType::kF64, {uint64_t{1} << 62}, 0}};
  auto shards = PlanShards(specs, 100, 1);
  REQUIRE_FALSE(shards.ok());
  CHECK(shards.status().message() ==
        "tensor \"w\": shape [4611686018427387904] x F64 exceeds the 1 PiB (2^50 bytes) tensor limit");
}

TEST_CASE("a name given twice is refused") {
  auto shards = PlanShards(std::vector{U8("w", 1), U8("x", 1), U8("w", 1)}, 100, 1);
  REQUIRE_FALSE(shards.ok());
  CHECK(shards.status().message() == "tensor \"w\" appears twice");
}

TEST_CASE("an unsafe tensor name is refused") {
  const std::vector<std::string> bad_names = {"", "/abs", "../up", std::string("nul\0x", 5),
                                             "__metadata__", "bad\xff"};
  for (const std::string& bad : bad_names) {
    auto shards = PlanShards(std::vector{U8(bad, 1)}, 100, 1);
    CHECK_FALSE(shards.ok());
  }
  CHECK(PlanShards(std::vector{U8("__metadata__", 1)}, 100, 1).status().message() ==
        "tensor name \"__metadata__\" is reserved by safetensors");
  CHECK(PlanShards(std::vector{U8("bad\xff", 1)}, 100, 1).status().message() ==
        "tensor name \"bad\xEF\xBF\xBD\" is not valid UTF-8");
}

TEST_CASE("a zero or huge shard size is refused") {
  CHECK(PlanShards(std::vector{U8("a", 1)}, 0, 1).status().message() == "shard_size 0 is outside [1, 2^50]");
  CHECK_FALSE(PlanShards(std::vector{U8("a", 1)}, base::kMaxTensorBytes + 1, 1).ok());
}

TEST_CASE("a zero or huge alignment is refused") {
  CHECK(PlanShards(std::vector{U8("a", 1)}, 100, 0).status().message() ==
        "shard alignment 0 is outside [1, 1 MiB]");
  CHECK_FALSE(PlanShards(std::vector{U8("a", 1)}, 100, size_t{1} << 30).ok());
}

TEST_CASE("a name prefix that would not make a plain file name is refused") {
  auto shards = PlanShards(std::vector{U8("a", 1)}, 100, 1, "../x-");
  REQUIRE_FALSE(shards.ok());
  CHECK(shards.status().message() ==
        "shard name \"../x-00000.safetensors\" is not a plain file name (only A-Z a-z 0-9 . _ - allowed)");
}

}  // namespace
}  // namespace ckptio::format
