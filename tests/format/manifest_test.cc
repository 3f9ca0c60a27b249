// manifest.json: round trips, hostile manifests refused with messages naming
// the file and the problem, and shard headers checked against the manifest.

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "format/manifest.h"

namespace ckptio::format {
namespace {

using nlohmann::json;

constexpr std::string_view kFile = "ckpt/checkpoint_200/manifest.json";

Manifest SampleManifest() {
  Manifest m;
  m.step = 200;
  m.created = "2024-05-01T12:00:00Z";
  m.writer = "ckptio 0.1.0";
  m.metadata = {{"epoch", 3}, {"note", "line\nbreak"}, {"nested", {{"a", {1, 2}}}}};
  m.shards = {{"shard-00000.safetensors", 4096 + 108, 0x11111111},
              {"shard-00001.safetensors", 4096 + 64, 0x22222222}};
  m.tensors = {{"params/w", DType::kF32, {5, 5}, 0, 4096, 100, 0xAAAAAAAA},
               {"step", DType::kI64, {}, 0, 4196, 8, 0xBBBBBBBB},
               {"params/b", DType::kBF16, {32}, 1, 4096, 64, 0x0000CCCC}};
  return m;
}

json SampleJson() { return json::parse(SerializeManifest(SampleManifest())); }

// The error message of parsing `text`, or "OK".
std::string ErrorOf(std::string_view text, Chunks chunks = Chunks::kComplete) {
  auto m = ParseManifest(kFile, text, chunks);
  if (m.ok()) return "OK";
  CHECK(m.status().code() == StatusCode::kCorruption);
  return m.status().message();
}

std::string JsonErrorOf(const json& j, Chunks chunks = Chunks::kComplete) {
  return ErrorOf(std::string_view(j.dump()), chunks);
}

bool Contains(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

// ---- Round trips ----------------------------------------------------------

TEST_CASE("a manifest round-trips through its json") {
  const Manifest m = SampleManifest();
  auto back = ParseManifest(kFile, SerializeManifest(m));
  REQUIRE(back.ok());
  CHECK(back->format_version == 1);
  CHECK(back->step == 200);
  CHECK(back->created == m.created);
  CHECK(back->writer == m.writer);
  CHECK(back->metadata == m.metadata);
  REQUIRE(back->shards.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(back->shards[i].name == m.shards[i].name);
    CHECK(back->shards[i].bytes == m.shards[i].bytes);
    CHECK(back->shards[i].crc32c == m.shards[i].crc32c);
  }
  REQUIRE(back->tensors.size() == 3);
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(back->tensors[i].name == m.tensors[i].name);
    CHECK(back->tensors[i].dtype == m.tensors[i].dtype);
    CHECK(back->tensors[i].shape == m.tensors[i].shape);
    CHECK(back->tensors[i].shard == m.tensors[i].shard);
    CHECK(back->tensors[i].offset == m.tensors[i].offset);
    CHECK(back->tensors[i].bytes == m.tensors[i].bytes);
    CHECK(back->tensors[i].crc32c == m.tensors[i].crc32c);
  }
}

TEST_CASE("the manifest json names shards by name and spells crcs as 8 hex digits") {
  const json j = SampleJson();
  CHECK(j["format_version"] == 1);
  CHECK(j["tensors"][2]["shard"] == "shard-00001.safetensors");
  CHECK(j["tensors"][2]["crc32c"] == "0000cccc");
  CHECK(j["shards"][0]["crc32c"] == "11111111");
  CHECK(j["tensors"][0]["dtype"] == "F32");
  CHECK(j["tensors"][1]["shape"] == json::array());
}

TEST_CASE("the manifest text puts each shard and tensor on one line") {
  const std::string text = SerializeManifest(SampleManifest());
  CHECK(Contains(text, "\n  \"step\": 200,\n"));
  CHECK(Contains(text, "\n    {\"bytes\":4204,\"crc32c\":\"11111111\",\"name\":\"shard-00000.safetensors\"}"));
  CHECK(Contains(text, "\"name\":\"params/w\""));
  CHECK(text.back() == '\n');
}

TEST_CASE("an empty manifest round-trips") {
  Manifest m;
  m.created = "1970-01-01T00:00:00Z";
  auto back = ParseManifest(kFile, SerializeManifest(m));
  REQUIRE(back.ok());
  CHECK(back->tensors.empty());
  CHECK(back->shards.empty());
  CHECK(back->metadata == json::object());
}

TEST_CASE("a manifest built for a writer passes the reader's validation") {
  CHECK(ValidateManifest(kFile, SampleManifest()).ok());
}

// `levels` arrays nested in one another.
json Nested(int levels) {
  json j = json::array();
  for (int i = 1; i < levels; ++i) j = json::array({j});
  return j;
}

TEST_CASE("metadata nested as deep as the parser allows round-trips") {
  Manifest m = SampleManifest();
  m.metadata = {{"deep", Nested(62)}};  // the innermost array is 62 levels below metadata
  REQUIRE(ValidateManifest(kFile, m).ok());
  auto back = ParseManifest(kFile, SerializeManifest(m));
  REQUIRE(back.ok());
  CHECK(back->metadata == m.metadata);
}

TEST_CASE("metadata nested deeper than the parser allows fails validation before it is written") {
  Manifest m = SampleManifest();
  m.metadata = {{"deep", Nested(63)}};
  CHECK(ValidateManifest(kFile, m).message() ==
        "ckpt/checkpoint_200/manifest.json: metadata nests deeper than 62 levels");
  CHECK(ErrorOf(SerializeManifest(m)) ==
        "ckpt/checkpoint_200/manifest.json: manifest nests deeper than 64 levels");
}

// ---- Hostile manifests ----------------------------------------------------

TEST_CASE("a manifest that is not json or not an object is refused") {
  CHECK(Contains(ErrorOf("{\"step\": }"), "ckpt/checkpoint_200/manifest.json: manifest is not valid JSON"));
  CHECK(ErrorOf("[]") == "ckpt/checkpoint_200/manifest.json: manifest is not a JSON object");
  CHECK(Contains(ErrorOf(""), "manifest is not valid JSON"));
}

TEST_CASE("a manifest over the size limit is refused before parsing") {
  const std::string huge(kMaxManifestBytes + 1, ' ');
  CHECK(ErrorOf(huge) == "ckpt/checkpoint_200/manifest.json: manifest of 268435457 bytes exceeds the "
                         "256 MiB limit");
}

TEST_CASE("an unsupported format version is refused before other fields") {
  json j = SampleJson();
  j["format_version"] = 4;
  j["new_field"] = true;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: unsupported format_version 4 (this reader knows 1 to 3)");
  j["format_version"] = 0;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: unsupported format_version 0 (this reader knows 1 to 3)");
  j["format_version"] = "1";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: field \"format_version\" must be a 64-bit integer");
}

TEST_CASE("a missing top-level field is refused naming it") {
  json j = SampleJson();
  j.erase("step");
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: missing field \"step\"");
}

TEST_CASE("an unknown top-level field is refused") {
  json j = SampleJson();
  j["extra"] = 1;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: unknown field \"extra\"");
}

TEST_CASE("wrongly typed top-level fields are refused naming them") {
  json j = SampleJson();
  j["step"] = "200";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: field \"step\" must be a 64-bit integer");
  j = SampleJson();
  j["shards"] = json::object();
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: field \"shards\" must be an array");
  j = SampleJson();
  j["metadata"] = json::array();
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: field \"metadata\" must be an object");
}

TEST_CASE("a negative step is refused") {
  json j = SampleJson();
  j["step"] = -1;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: step -1 is negative");
}

TEST_CASE("a created time that is not rfc 3339 utc is refused") {
  json j = SampleJson();
  j["created"] = "2024-05-01 12:00:00";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: created \"2024-05-01 12:00:00\" is not an "
                      "RFC 3339 UTC time");
}

TEST_CASE("a key repeated in the manifest json is refused") {
  std::string text = SerializeManifest(SampleManifest());
  text.insert(1, "\"step\": 100,");
  CHECK(ErrorOf(text) == "ckpt/checkpoint_200/manifest.json: manifest has the key \"step\" twice in one object");
}

TEST_CASE("a shard entry missing a field or with a bad crc is refused naming the shard") {
  json j = SampleJson();
  j["shards"][1].erase("bytes");
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: shard \"shard-00001.safetensors\": missing field \"bytes\"");
  j = SampleJson();
  j["shards"][0]["crc32c"] = "xyz";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: shard \"shard-00000.safetensors\": CRC32C \"xyz\" is "
                      "not 8 hex digits");
  j = SampleJson();
  j["shards"][0]["crc32c"] = 12345;
  CHECK(Contains(JsonErrorOf(j), "field \"crc32c\" must be a string"));
}

TEST_CASE("an entry without a name is refused naming its position") {
  json j = SampleJson();
  j["tensors"][1].erase("name");
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensors[1]: missing field \"name\"");
  j = SampleJson();
  j["shards"][0] = 7;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: shards[0] is not a JSON object");
}

TEST_CASE("shard names that are not plain file names are refused") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"../x", "shard name \"../x\" is not a plain file name (only A-Z a-z 0-9 . _ - allowed)"},
      {"a/b", "shard name \"a/b\" is not a plain file name (only A-Z a-z 0-9 . _ - allowed)"},
      {".", "shard name \".\" is not a plain file name"},
      {"..", "shard name \"..\" is not a plain file name"},
      {"", "shard name is empty"},
      {std::string(256, 'a'), "is longer than 255 characters"},
      {"shard 1", "is not a plain file name"},
  };
  for (const auto& [name, problem] : cases) {
    CAPTURE(name);
    json j = SampleJson();
    j["shards"][1]["name"] = name;
    j["tensors"][2]["shard"] = name;
    const std::string error = JsonErrorOf(j);
    CHECK(error.starts_with("ckpt/checkpoint_200/manifest.json: "));
    CHECK(Contains(error, problem));
  }
}

TEST_CASE("a shard name of 255 characters is allowed") {
  json j = SampleJson();
  j["shards"][1]["name"] = std::string(255, 'a');
  j["tensors"][2]["shard"] = std::string(255, 'a');
  CHECK(JsonErrorOf(j) == "OK");
}

TEST_CASE("a shard listed twice is refused") {
  json j = SampleJson();
  j["shards"][1]["name"] = "shard-00000.safetensors";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: shard \"shard-00000.safetensors\" is listed twice");
}

TEST_CASE("a tensor listed twice is refused") {
  json j = SampleJson();
  j["tensors"][2]["name"] = "params/w";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"params/w\" is listed twice");
}

TEST_CASE("hostile tensor names are refused") {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "tensor name is empty"},
      {"/abs", "tensor name \"/abs\" is an absolute path"},
      {"a/../b", "tensor name \"a/../b\" contains a \"..\" path component"},
      {std::string("a\0b", 3), "tensor name \"a\\u0000b\" contains a NUL byte"},
  };
  for (const auto& [name, problem] : cases) {
    json j = SampleJson();
    j["tensors"][0]["name"] = name;
    CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: " + problem);
  }
}

TEST_CASE("a tensor naming a shard the manifest does not list is refused") {
  json j = SampleJson();
  j["tensors"][0]["shard"] = "shard-00009.safetensors";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"params/w\": names shard "
                      "\"shard-00009.safetensors\", which the manifest does not list");
}

TEST_CASE("a tensor with an unknown field or dtype is refused naming it") {
  json j = SampleJson();
  j["tensors"][0]["strides"] = json::array({5, 1});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"params/w\": unknown field \"strides\"");
  j = SampleJson();
  j["tensors"][0]["dtype"] = "F128";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"params/w\": unknown dtype \"F128\"");
}

TEST_CASE("a tensor running past the end of its shard is refused") {
  json j = SampleJson();
  j["tensors"][0]["offset"] = 4105;  // 4105 + 100 > 4204
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"params/w\": offset 4105 + 100 bytes "
                      "runs past the end of shard \"shard-00000.safetensors\" (4204 bytes)");
}

TEST_CASE("an offset that would overflow when added to the size is refused") {
  json j = SampleJson();
  j["tensors"][0]["offset"] = UINT64_MAX - 50;  // offset + 100 wraps to 49
  CHECK(Contains(JsonErrorOf(j), "runs past the end of shard"));
}

TEST_CASE("tensors overlapping in a shard are refused") {
  json j = SampleJson();
  j["tensors"][1]["offset"] = 4190;  // inside params/w [4096, 4196)
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensors \"params/w\" and \"step\" overlap in "
                      "shard \"shard-00000.safetensors\"");
}

TEST_CASE("tensors at the same offset in different shards do not overlap") {
  json j = SampleJson();
  CHECK(j["tensors"][0]["offset"] == j["tensors"][2]["offset"]);
  CHECK(JsonErrorOf(j) == "OK");
}

TEST_CASE("a zero-byte tensor inside another one is not an overlap") {
  json j = SampleJson();
  j["tensors"][1]["shape"] = json::array({0});
  j["tensors"][1]["bytes"] = 0;
  j["tensors"][1]["offset"] = 4100;
  CHECK(JsonErrorOf(j) == "OK");
}

TEST_CASE("bytes that disagree with shape times dtype size are refused") {
  json j = SampleJson();
  j["tensors"][0]["bytes"] = 99;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"params/w\": bytes 99 do not match "
                      "shape [5, 5] x F32 = 100 bytes");
}

TEST_CASE("huge shapes and shards are refused") {
  json j = SampleJson();
  j["tensors"][0]["shape"] = json::array({uint64_t{1} << 40, uint64_t{1} << 40});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"params/w\": shape [1099511627776, "
                      "1099511627776] x F32 exceeds the 1 PiB (2^50 bytes) tensor limit");
  j = SampleJson();
  j["shards"][0]["bytes"] = (uint64_t{1} << 51) + 1;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: shard \"shard-00000.safetensors\": "
                      "2251799813685249 bytes exceeds the 2 PiB (2^51 bytes) shard limit");
}

TEST_CASE("a negative size is refused as a wrong type") {
  json j = SampleJson();
  j["tensors"][0]["offset"] = -4096;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"params/w\": field \"offset\" must be an "
                      "unsigned integer");
}

TEST_CASE("every truncation of a valid manifest is refused") {
  const std::string text = SerializeManifest(SampleManifest());
  for (size_t n = 0; n + 1 < text.size(); ++n) {  // the last byte is a newline
    CAPTURE(n);
    const std::string cut = text.substr(0, n);  // own allocation: ASan sees over-reads
    auto m = ParseManifest(kFile, cut);
    REQUIRE_FALSE(m.ok());
    CHECK(m.status().message().starts_with("ckpt/checkpoint_200/manifest.json: "));
  }
}

TEST_CASE("validation refuses a tensor whose shard index is out of range") {
  Manifest m = SampleManifest();
  m.tensors[0].shard = 7;
  const Status s = ValidateManifest(kFile, m);
  CHECK(s.code() == StatusCode::kCorruption);
  CHECK(s.message() == "ckpt/checkpoint_200/manifest.json: tensor \"params/w\": shard index 7 is out of "
                       "range (2 shards)");
}

// ---- Chunks of arrays (format_version 2) ---------------------------------

// Array "w" (F32, global shape [64, 8]) in three chunks: rows 0-16 whole, rows
// 16-64 split by columns at 4; and a whole tensor "step".
Manifest ChunkedManifest() {
  Manifest m;
  m.format_version = 2;
  m.step = 200;
  m.created = "2024-05-01T12:00:00Z";
  m.writer = "ckptio 0.2.0";
  m.metadata = {{"epoch", 3}};
  m.shards = {{"shard-00000.safetensors", 4096 + 512 + 768 + 768 + 8, 0x11111111}};
  m.tensors = {{"w@0,0", DType::kF32, {16, 8}, 0, 4096, 512, 0xA0, {"w", {64, 8}, {0, 0}}},
               {"w@16,0", DType::kF32, {48, 4}, 0, 4608, 768, 0xA1, {"w", {64, 8}, {16, 0}}},
               {"w@16,4", DType::kF32, {48, 4}, 0, 5376, 768, 0xA2, {"w", {64, 8}, {16, 4}}},
               {"step", DType::kI64, {}, 0, 6144, 8, 0xBB}};
  return m;
}

json ChunkedJson() { return json::parse(SerializeManifest(ChunkedManifest())); }

// Moves chunk i of manifest json `j` to `start`, renamed to match.
void MoveChunk(json& j, size_t i, const std::vector<uint64_t>& start) {
  j["tensors"][i]["name"] = ChunkName(j["tensors"][i]["array"].get<std::string>(), start);
  j["tensors"][i]["start"] = start;
}

// A chunk of U8 array "a", as CheckChunks sees it.
ManifestTensor ChunkOfA(std::vector<uint64_t> global_shape, std::vector<uint64_t> start,
                        std::vector<uint64_t> shape) {
  ManifestTensor t;
  t.name = ChunkName("a", start);
  t.dtype = DType::kU8;
  t.shape = std::move(shape);
  t.chunk = {"a", std::move(global_shape), std::move(start)};
  return t;
}

// CheckChunks' message, or "OK".
std::string ChunkErrorOf(const std::vector<ManifestTensor>& tensors, Chunks chunks) {
  const Status s = CheckChunks(kFile, tensors, chunks);
  if (s.ok()) return "OK";
  CHECK(s.code() == StatusCode::kCorruption);
  return s.message();
}

TEST_CASE("a manifest with an array split into chunks round-trips with every chunk field") {
  const Manifest m = ChunkedManifest();
  REQUIRE(ValidateManifest(kFile, m).ok());
  const std::string text = SerializeManifest(m);
  auto back = ParseManifest(kFile, text);
  REQUIRE_MESSAGE(back.ok(), back.status().ToString());
  CHECK(back->format_version == 2);
  REQUIRE(back->tensors.size() == 4);
  for (size_t i = 0; i < 4; ++i) {
    CAPTURE(i);
    const ManifestTensor& t = back->tensors[i];
    CHECK(t.name == m.tensors[i].name);
    CHECK(t.dtype == m.tensors[i].dtype);
    CHECK(t.shape == m.tensors[i].shape);
    CHECK(t.shard == m.tensors[i].shard);
    CHECK(t.offset == m.tensors[i].offset);
    CHECK(t.bytes == m.tensors[i].bytes);
    CHECK(t.crc32c == m.tensors[i].crc32c);
    CHECK(t.chunk.array == m.tensors[i].chunk.array);
    CHECK(t.chunk.global_shape == m.tensors[i].chunk.global_shape);
    CHECK(t.chunk.start == m.tensors[i].chunk.start);
  }
  CHECK(back->tensors[2].chunk.start == std::vector<uint64_t>{16, 4});
  CHECK(back->tensors[3].chunk.empty());
  CHECK(SerializeManifest(*back) == text);
}

TEST_CASE("the manifest json has array, global_shape and start on chunk tensors only") {
  const std::string text = SerializeManifest(ChunkedManifest());
  CHECK(Contains(text, "\n  \"format_version\": 2,\n"));
  CHECK(Contains(text, "\n    {\"array\":\"w\",\"bytes\":768,\"crc32c\":\"000000a1\",\"dtype\":\"F32\","
                       "\"global_shape\":[64,8],\"name\":\"w@16,0\",\"offset\":4608,\"shape\":[48,4],"
                       "\"shard\":\"shard-00000.safetensors\",\"start\":[16,0]},\n"));
  CHECK(Contains(text, "\n    {\"bytes\":8,\"crc32c\":\"000000bb\",\"dtype\":\"I64\",\"name\":\"step\","
                       "\"offset\":6144,\"shape\":[],\"shard\":\"shard-00000.safetensors\"}\n  ]"));
  const json j = json::parse(text);
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    CHECK(j["tensors"][i]["array"] == "w");
    CHECK(j["tensors"][i]["global_shape"] == json::array({64, 8}));
  }
  CHECK(j["tensors"][2]["start"] == json::array({16, 4}));
  CHECK_FALSE(j["tensors"][3].contains("array"));
  CHECK_FALSE(j["tensors"][3].contains("global_shape"));
  CHECK_FALSE(j["tensors"][3].contains("start"));
  CHECK_FALSE(Contains(SerializeManifest(SampleManifest()), "\"array\""));
}

TEST_CASE("the format version is 1 without chunks and 2 with one") {
  CHECK(FormatVersionFor(std::vector<ManifestTensor>{}) == 1);
  CHECK(FormatVersionFor(SampleManifest().tensors) == 1);
  CHECK(FormatVersionFor(ChunkedManifest().tensors) == 2);
  std::vector<ManifestTensor> one = SampleManifest().tensors;
  one.push_back(ChunkedManifest().tensors[1]);
  CHECK(FormatVersionFor(one) == 2);
}

TEST_CASE("a version 1 manifest with chunks is refused") {
  json j = ChunkedJson();
  j["format_version"] = 1;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@0,0\": unknown field \"array\"");
  Manifest m = ChunkedManifest();
  m.format_version = 1;
  const Status s = ValidateManifest(kFile, m);
  CHECK(s.code() == StatusCode::kCorruption);
  CHECK(s.message() == "ckpt/checkpoint_200/manifest.json: tensors split into chunks need format_version 2, the "
                       "manifest says 1");
}

TEST_CASE("a version 2 manifest without chunks is read") {
  json j = SampleJson();
  j["format_version"] = 2;
  auto m = ParseManifest(kFile, j.dump());
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  CHECK(m->format_version == 2);
  CHECK(m->tensors.size() == 3);
}

TEST_CASE("chunk fields that are incomplete, empty, mistyped or on a whole tensor are refused") {
  json j = ChunkedJson();
  j["tensors"][0].erase("start");
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@0,0\": missing field \"start\"");
  j = ChunkedJson();
  j["tensors"][0]["array"] = "";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@0,0\": field \"array\" is empty");
  j = ChunkedJson();
  j["tensors"][0]["global_shape"] = json::array({64, -8});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@0,0\": field \"global_shape\" must be an "
                          "array of unsigned integers");
  j = ChunkedJson();
  j["tensors"][3]["start"] = json::array();
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"step\": unknown field \"start\"");
  j = ChunkedJson();
  j["tensors"][0]["array"] = "../w";
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@0,0\": array: tensor name \"../w\" "
                          "contains a \"..\" path component");
}

TEST_CASE("a chunk running past its array on an axis is refused naming the file, the chunk and the array") {
  json j = ChunkedJson();
  MoveChunk(j, 2, {16, 5});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@16,5\": chunk [16:64, 5:9] runs past "
                          "axis 1 of array \"w\", whose global shape is [64, 8]");
  j = ChunkedJson();
  MoveChunk(j, 0, {50, 0});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@50,0\": chunk [50:66, 0:8] runs past "
                          "axis 0 of array \"w\", whose global shape is [64, 8]");
  j = ChunkedJson();
  MoveChunk(j, 0, {65, 0});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@65,0\": chunk [65:81, 0:8] runs past "
                          "axis 0 of array \"w\", whose global shape is [64, 8]");
  // Partial or not: a chunk outside its array is never right.
  CHECK(JsonErrorOf(j, Chunks::kPartial) == JsonErrorOf(j));
}

TEST_CASE("huge chunk starts are refused without overflowing") {
  json j = ChunkedJson();
  MoveChunk(j, 0, {uint64_t{1} << 63, 0});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@9223372036854775808,0\": chunk "
                          "[9223372036854775808:9223372036854775824, 0:8] runs past axis 0 of array \"w\", whose "
                          "global shape is [64, 8]");
  // start + extent wraps to 8, inside the array, were it computed in 64 bits.
  j = ChunkedJson();
  MoveChunk(j, 0, {UINT64_MAX - 7, 0});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@18446744073709551608,0\": chunk "
                          "[18446744073709551608:18446744073709551624, 0:8] runs past axis 0 of array \"w\", whose "
                          "global shape is [64, 8]");
  // Inside a global shape that large, which is itself refused.
  j = ChunkedJson();
  for (json& t : j["tensors"]) {
    if (t.contains("global_shape")) t["global_shape"] = json::array({UINT64_MAX, 8});
  }
  MoveChunk(j, 0, {uint64_t{1} << 63, 0});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@9223372036854775808,0\": global_shape of "
                          "array \"w\": shape [18446744073709551615, 8] x F32 exceeds the 1 PiB (2^50 bytes) "
                          "tensor limit");
}

TEST_CASE("a chunk of hundreds of axes is refused with a short message") {
  // 48 axes at start 2^64 - 2 of extent 1, the last one past its array: the
  // message shows 16 axes (hostile manifests must not flood logs).
  const size_t rank = 48;
  ManifestTensor t;
  t.dtype = DType::kU8;
  t.shape.assign(rank, 1);
  t.chunk = {"a", std::vector<uint64_t>(rank, UINT64_MAX), std::vector<uint64_t>(rank, UINT64_MAX - 1)};
  t.chunk.global_shape.back() = UINT64_MAX - 1;
  t.name = ChunkName("a", t.chunk.start);
  const std::string error = ChunkErrorOf({t}, Chunks::kPartial);
  CHECK(error.size() <= 2048);
  CHECK(Contains(error, ", 18446744073709551614:18446744073709551615, ... (48 dims)] runs past axis 47 of array "
                        "\"a\", whose global shape is [18446744073709551615, "));
}

TEST_CASE("a chunk whose shape, global shape and start differ in rank is refused") {
  json j = ChunkedJson();
  MoveChunk(j, 0, {0});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@0\": a chunk's shape, global_shape and "
                          "start need one entry per axis; they have 2, 2 and 1");
  j = ChunkedJson();
  j["tensors"][0]["global_shape"] = json::array({64, 8, 1});
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"w@0,0\": a chunk's shape, global_shape and "
                          "start need one entry per axis; they have 2, 3 and 2");
}

TEST_CASE("a chunk not named after its array and start is refused") {
  for (const std::string name : {"w@16", "w@016,0", "w@16,0,", "w", "v@16,0"}) {
    CAPTURE(name);
    json j = ChunkedJson();
    j["tensors"][1]["name"] = name;
    CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: tensor \"" + name +
                                "\": the chunk of array \"w\" at [16, 0] must be named \"w@16,0\"");
  }
}

TEST_CASE("chunks of one array that disagree on dtype or global shape are refused naming both") {
  json j = ChunkedJson();
  j["tensors"][1]["dtype"] = "F16";
  j["tensors"][1]["bytes"] = 384;
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: chunks \"w@0,0\" and \"w@16,0\" of array \"w\" "
                          "disagree on its dtype or global shape (F32 [64, 8] against F16 [64, 8])");
  j = ChunkedJson();
  j["tensors"][2]["global_shape"] = json::array({64, 9});
  CHECK(JsonErrorOf(j, Chunks::kPartial) == "ckpt/checkpoint_200/manifest.json: chunks \"w@0,0\" and \"w@16,4\" of "
                                            "array \"w\" disagree on its dtype or global shape (F32 [64, 8] against "
                                            "F32 [64, 9])");
}

TEST_CASE("overlapping chunks are refused naming both and their boxes, in a fragment too") {
  json j = ChunkedJson();
  MoveChunk(j, 1, {8, 0});
  const std::string want = "ckpt/checkpoint_200/manifest.json: chunks \"w@0,0\" [0:16, 0:8] and \"w@8,0\" [8:56, "
                           "0:4] of array \"w\" overlap";
  CHECK(JsonErrorOf(j) == want);
  CHECK(JsonErrorOf(j, Chunks::kPartial) == want);
}

TEST_CASE("chunks split along axis 1 only are checked for overlap along it") {
  // Listed out of order; every chunk spans all of axis 0.
  std::vector<ManifestTensor> chunks = {ChunkOfA({4, 12}, {0, 8}, {4, 4}), ChunkOfA({4, 12}, {0, 0}, {4, 4}),
                                        ChunkOfA({4, 12}, {0, 4}, {4, 4})};
  CHECK(ChunkErrorOf(chunks, Chunks::kComplete) == "OK");
  chunks[1].shape = {4, 5};  // columns 0-5: one column into the next chunk
  CHECK(ChunkErrorOf(chunks, Chunks::kPartial) == "ckpt/checkpoint_200/manifest.json: chunks \"a@0,0\" [0:4, 0:5] "
                                                  "and \"a@0,4\" [0:4, 4:8] of array \"a\" overlap");
  chunks[1].shape = {4, 4};
  chunks[2].shape = {4, 5};  // columns 4-9 against 8-12
  CHECK(ChunkErrorOf(chunks, Chunks::kPartial) == "ckpt/checkpoint_200/manifest.json: chunks \"a@0,4\" [0:4, 4:9] "
                                                  "and \"a@0,8\" [0:4, 8:12] of array \"a\" overlap");
}

TEST_CASE("a grid of chunks swept along axis 1 is checked on every axis") {
  // Rows 0-2 in four column blocks, rows 2-4 in two: more distinct starts on
  // axis 1, so the sweep runs along it and chunks open there may still be
  // apart on axis 0.
  const std::vector<uint64_t> g = {4, 12};
  std::vector<ManifestTensor> grid = {ChunkOfA(g, {0, 0}, {2, 3}), ChunkOfA(g, {0, 3}, {2, 3}),
                                      ChunkOfA(g, {0, 6}, {2, 3}), ChunkOfA(g, {0, 9}, {2, 3}),
                                      ChunkOfA(g, {2, 0}, {2, 6}), ChunkOfA(g, {2, 6}, {2, 6})};
  CHECK(ChunkErrorOf(grid, Chunks::kComplete) == "OK");
  std::vector<ManifestTensor> late = grid;
  late[5] = ChunkOfA(g, {1, 7}, {3, 5});  // row 1 is also in the top row's blocks
  CHECK(ChunkErrorOf(late, Chunks::kPartial) == "ckpt/checkpoint_200/manifest.json: chunks \"a@0,6\" [0:2, 6:9] "
                                                "and \"a@1,7\" [1:4, 7:12] of array \"a\" overlap");
  std::vector<ManifestTensor> long_open = grid;
  long_open[4].shape = {2, 7};  // still open when the sweep reaches column 6
  CHECK(ChunkErrorOf(long_open, Chunks::kPartial) == "ckpt/checkpoint_200/manifest.json: chunks \"a@2,0\" [2:4, "
                                                     "0:7] and \"a@2,6\" [2:4, 6:12] of array \"a\" overlap");
}

TEST_CASE("a missing chunk is refused in a checkpoint's manifest but allowed in a process's fragment") {
  json j = ChunkedJson();
  j["tensors"].erase(2);
  CHECK(JsonErrorOf(j) == "ckpt/checkpoint_200/manifest.json: the chunks of array \"w\" cover 320 of the 512 "
                          "elements of its global shape [64, 8]: a chunk is missing");
  auto partial = ParseManifest(kFile, j.dump(), Chunks::kPartial);
  REQUIRE_MESSAGE(partial.ok(), partial.status().ToString());
  CHECK(partial->tensors.size() == 3);
  Manifest m = ChunkedManifest();
  m.tensors.erase(m.tensors.begin());
  CHECK(ValidateManifest(kFile, m, Chunks::kPartial).ok());
  CHECK(ValidateManifest(kFile, m).message() == "ckpt/checkpoint_200/manifest.json: the chunks of array \"w\" cover "
                                                "384 of the 512 elements of its global shape [64, 8]: a chunk is "
                                                "missing");
}

TEST_CASE("a whole tensor named like an array is refused") {
  json j = ChunkedJson();
  j["tensors"][3]["name"] = "w";
  const std::string want = "ckpt/checkpoint_200/manifest.json: \"w\" is both a whole tensor and an array split into "
                           "chunks";
  CHECK(JsonErrorOf(j) == want);
  CHECK(JsonErrorOf(j, Chunks::kPartial) == want);
}

TEST_CASE("an array whose global shape exceeds the tensor size limit is refused") {
  json j = ChunkedJson();
  for (json& t : j["tensors"]) {
    if (t.contains("global_shape")) t["global_shape"] = json::array({uint64_t{1} << 40, uint64_t{1} << 40});
  }
  CHECK(JsonErrorOf(j, Chunks::kPartial) == "ckpt/checkpoint_200/manifest.json: tensor \"w@0,0\": global_shape of "
                                            "array \"w\": shape [1099511627776, 1099511627776] x F32 exceeds the 1 "
                                            "PiB (2^50 bytes) tensor limit");
  // 2^50 bytes exactly is allowed; a byte more is not.
  CHECK(ChunkErrorOf({ChunkOfA({uint64_t{1} << 50}, {0}, {16})}, Chunks::kPartial) == "OK");
  CHECK(ChunkErrorOf({ChunkOfA({(uint64_t{1} << 50) + 1}, {0}, {16})}, Chunks::kPartial) ==
        "ckpt/checkpoint_200/manifest.json: tensor \"a@0\": global_shape of array \"a\": shape [1125899906842625] x "
        "U8 exceeds the 1 PiB (2^50 bytes) tensor limit");
}

TEST_CASE("zero-size arrays and chunks are accepted") {
  // An empty array in two empty chunks, and a scalar array in its one chunk.
  CHECK(ChunkErrorOf({ChunkOfA({0, 8}, {0, 0}, {0, 4}), ChunkOfA({0, 8}, {0, 4}, {0, 4})}, Chunks::kComplete) ==
        "OK");
  CHECK(ChunkErrorOf({ChunkOfA({}, {}, {})}, Chunks::kComplete) == "OK");
  // Empty chunks at the far edge of "w" and inside another chunk's box.
  Manifest m = ChunkedManifest();
  m.tensors.push_back({"w@64,0", DType::kF32, {0, 8}, 0, 6152, 0, 0, {"w", {64, 8}, {64, 0}}, {}});
  m.tensors.push_back({"w@8,2", DType::kF32, {4, 0}, 0, 4096, 0, 0, {"w", {64, 8}, {8, 2}}, {}});
  CHECK(ValidateManifest(kFile, m).ok());
  CHECK(ErrorOf(SerializeManifest(m)) == "OK");
}

// ---- Shard headers against the manifest -----------------------------------

struct PlannedCheckpoint {
  std::vector<TensorSpec> specs;
  std::vector<PlannedShard> shards;
  Manifest manifest;
};

// A manifest for a real plan, as the save pipeline would write it.
PlannedCheckpoint MakePlanned() {
  PlannedCheckpoint p;
  p.specs = {{"w", DType::kF32, {5, 5}, 100}, {"b", DType::kF16, {10}, 20}, {"big", DType::kU8, {300}, 300}};
  p.shards = PlanShards(p.specs, 200, 4096).value();
  p.manifest.created = "2024-05-01T12:00:00Z";
  for (size_t s = 0; s < p.shards.size(); ++s) {
    p.manifest.shards.push_back({p.shards[s].name, p.shards[s].file_size, 0, {}});
    for (const PlannedTensor& t : p.shards[s].tensors) {
      const TensorSpec& spec = p.specs[t.index];
      p.manifest.tensors.push_back(
          {spec.name, spec.dtype, spec.shape, static_cast<uint32_t>(s), t.offset, t.bytes, 0});
    }
  }
  return p;
}

SafetensorsHeader HeaderOf(const PlannedShard& shard) {
  const std::vector<uint8_t> json(shard.prefix.begin() + 8, shard.prefix.end());
  return ParseSafetensorsHeader(shard.name, json, shard.file_size).value();
}

TEST_CASE("planned shards match the manifest written for them") {
  const PlannedCheckpoint p = MakePlanned();
  REQUIRE(p.shards.size() == 2);
  REQUIRE(ValidateManifest(kFile, p.manifest).ok());
  for (size_t s = 0; s < p.shards.size(); ++s) {
    CHECK(CheckShardMatchesManifest(p.manifest, s, HeaderOf(p.shards[s]), p.shards[s].file_size).ok());
  }
}

TEST_CASE("a shard file of another size than the manifest says is refused") {
  const PlannedCheckpoint p = MakePlanned();
  const Status s = CheckShardMatchesManifest(p.manifest, 0, HeaderOf(p.shards[0]), p.shards[0].file_size - 1);
  CHECK(s.code() == StatusCode::kCorruption);
  CHECK(s.message() == "shard-00000.safetensors: file is 4215 bytes, the manifest says 4216");
}

TEST_CASE("a shard header with another dtype or shape than the manifest is refused") {
  PlannedCheckpoint p = MakePlanned();
  p.manifest.tensors[1].dtype = DType::kBF16;
  CHECK(CheckShardMatchesManifest(p.manifest, 0, HeaderOf(p.shards[0]), p.shards[0].file_size).message() ==
        "shard-00000.safetensors: tensor \"b\": dtype F16 in the shard header, BF16 in the manifest");
  p = MakePlanned();
  p.manifest.tensors[0].shape = {25};
  CHECK(CheckShardMatchesManifest(p.manifest, 0, HeaderOf(p.shards[0]), p.shards[0].file_size).message() ==
        "shard-00000.safetensors: tensor \"w\": shape [5, 5] in the shard header, [25] in the manifest");
}

TEST_CASE("a shard header placing a tensor elsewhere than the manifest is refused") {
  PlannedCheckpoint p = MakePlanned();
  p.manifest.tensors[1].offset += 4;
  CHECK(CheckShardMatchesManifest(p.manifest, 0, HeaderOf(p.shards[0]), p.shards[0].file_size).message() ==
        "shard-00000.safetensors: tensor \"b\": data at offset 4200 (20 bytes) in the manifest, "
        "data_offsets [100, 120] after the header's 4096 bytes in the shard");
}

TEST_CASE("a tensor the manifest places in a shard whose header lacks it is refused") {
  PlannedCheckpoint p = MakePlanned();
  p.manifest.tensors[0].name = "renamed";
  CHECK(CheckShardMatchesManifest(p.manifest, 0, HeaderOf(p.shards[0]), p.shards[0].file_size).message() ==
        "shard-00000.safetensors: tensor \"renamed\" is in the manifest but not in the shard header");
}

TEST_CASE("a tensor in a shard header but not in the manifest is refused") {
  PlannedCheckpoint p = MakePlanned();
  p.manifest.tensors.erase(p.manifest.tensors.begin() + 1);
  CHECK(CheckShardMatchesManifest(p.manifest, 0, HeaderOf(p.shards[0]), p.shards[0].file_size).message() ==
        "shard-00000.safetensors: tensor \"b\" is in the shard header but not in the manifest");
}

TEST_CASE("checking a shard index the manifest does not have is an invalid argument") {
  const PlannedCheckpoint p = MakePlanned();
  const Status s = CheckShardMatchesManifest(p.manifest, 5, HeaderOf(p.shards[0]), p.shards[0].file_size);
  CHECK(s.code() == StatusCode::kInvalidArgument);
  CHECK(s.message() == "shard index 5 is out of range (2 shards)");
}

// ---- Times ----------------------------------------------------------------

TEST_CASE("times format as rfc 3339 utc with second precision") {
  using std::chrono::system_clock;
  CHECK(FormatRfc3339Utc(system_clock::time_point{}) == "1970-01-01T00:00:00Z");
  CHECK(FormatRfc3339Utc(system_clock::from_time_t(1714564800) + std::chrono::milliseconds(999)) ==
        "2024-05-01T12:00:00Z");
}

TEST_CASE("rfc 3339 utc times are recognised and others are not") {
  CHECK(IsRfc3339Utc("2024-05-01T12:00:00Z"));
  CHECK(IsRfc3339Utc("2024-05-01T12:00:00.123456Z"));
  CHECK(IsRfc3339Utc("2016-12-31T23:59:60Z"));  // a leap second
  for (std::string_view bad : {"", "2024-05-01T12:00:00", "2024-05-01T12:00:00+01:00", "2024-13-01T12:00:00Z",
                               "2024-05-00T12:00:00Z", "2024-05-01T24:00:00Z", "2024-05-01t12:00:00Z",
                               "2024-05-01T12:00:00.Z", "2024-5-01T12:00:00Z"}) {
    CAPTURE(bad);
    CHECK_FALSE(IsRfc3339Utc(bad));
  }
}

// ---- Incremental saves (format_version 3) ------------------------------------

// Step 200 keeps its own shard 0 and uses shard 0 of checkpoint_100 for the
// tensors that did not change since; every tensor has its content hash.
Manifest IncrementalManifest() {
  Manifest m = SampleManifest();
  m.shards[1].checkpoint = "checkpoint_100";
  m.shards[1].name = "shard-00000.safetensors";  // the same file name as this step's shard 0
  for (size_t i = 0; i < m.tensors.size(); ++i) m.tensors[i].xxh3 = Hash128{0x0123456789abcdefull + i, 0xfedcba9876543210ull};
  m.format_version = FormatVersionFor(m);
  return m;
}

TEST_CASE("an incremental manifest round-trips: hashes, and shards of an earlier checkpoint by path") {
  const Manifest m = IncrementalManifest();
  CHECK(m.format_version == 3);
  const std::string text = SerializeManifest(m);
  CHECK(text.find(R"("name":"checkpoint_100/shard-00000.safetensors")") != std::string::npos);
  CHECK(text.find(R"("shard":"checkpoint_100/shard-00000.safetensors")") != std::string::npos);
  CHECK(text.find(R"("xxh3":"0123456789abcdeffedcba9876543210")") != std::string::npos);
  auto back = ParseManifest(kFile, text);
  REQUIRE_MESSAGE(back.ok(), back.status().ToString());
  CHECK(back->format_version == 3);
  REQUIRE(back->shards.size() == 2);
  CHECK(back->shards[0].checkpoint.empty());
  CHECK(back->shards[1].checkpoint == "checkpoint_100");
  CHECK(back->shards[1].name == "shard-00000.safetensors");
  CHECK(back->tensors[2].shard == 1);
  REQUIRE(back->tensors[2].xxh3.has_value());
  CHECK(*back->tensors[2].xxh3 == *m.tensors[2].xxh3);
  CHECK(SerializeManifest(*back) == text);
}

TEST_CASE("hashes and shards of other checkpoints need format_version 3") {
  Manifest m = IncrementalManifest();
  m.format_version = 2;
  CHECK(ValidateManifest(kFile, m).message() ==
        "ckpt/checkpoint_200/manifest.json: content hashes and shards of other checkpoints need format_version 3, "
        "the manifest says 2");
  json j = json::parse(SerializeManifest(IncrementalManifest()));
  j["format_version"] = 2;
  CHECK(Contains(JsonErrorOf(j), "tensor \"params/w\": unknown field \"xxh3\""));
  for (json& t : j["tensors"]) t.erase("xxh3");
  // Version 2 knows no paths: the name is checked as a plain file name.
  CHECK(Contains(JsonErrorOf(j), "checkpoint_100/shard-00000.safetensors"));
  j["format_version"] = 4;
  CHECK(Contains(JsonErrorOf(j), "unsupported format_version 4 (this reader knows 1 to 3)"));
}

TEST_CASE("a shard path outside the root, into an unfinished save, or nested is refused") {
  for (const std::string bad : {"../shard-00000.safetensors", "../../etc/shard-00000.safetensors",
                                "./shard-00000.safetensors", "checkpoint_100.tmp-1f2e/shard-00000.safetensors",
                                "a/b/shard-00000.safetensors", "/shard-00000.safetensors",
                                "checkpoint_100/..", "checkpoint_100/"}) {
    json j = json::parse(SerializeManifest(IncrementalManifest()));
    j["shards"][1]["name"] = bad;
    for (json& t : j["tensors"]) {
      if (t["shard"] == "checkpoint_100/shard-00000.safetensors") t["shard"] = bad;
    }
    const std::string error = JsonErrorOf(j);
    CHECK_MESSAGE(error != "OK", bad);
  }
}

TEST_CASE("a malformed content hash is refused naming the tensor") {
  json j = json::parse(SerializeManifest(IncrementalManifest()));
  j["tensors"][0]["xxh3"] = "0123";
  CHECK(Contains(JsonErrorOf(j), "tensor \"params/w\": content hash \"0123\" is not 32 hex digits"));
  j["tensors"][0]["xxh3"] = 5;
  CHECK(Contains(JsonErrorOf(j), "tensor \"params/w\""));
  j["tensors"][0]["xxh3"] = "0123456789abcdeffedcba987654321g";
  CHECK(Contains(JsonErrorOf(j), "is not 32 hex digits"));
}

TEST_CASE("a shard of an earlier checkpoint may hold more tensors than the manifest places in it") {
  const Manifest m = IncrementalManifest();
  SafetensorsHeader header;
  header.data_start = 4096;
  header.tensors = {{"params/b", DType::kBF16, {32}, 0, 64}, {"changed_since", DType::kF32, {4}, 64, 80}};
  CHECK(CheckShardMatchesManifest(m, 1, header, 4096 + 64).ok());
  // This step's own shard may not.
  Manifest own = SampleManifest();
  CHECK(CheckShardMatchesManifest(own, 1, header, 4096 + 64).message() ==
        "shard-00001.safetensors: tensor \"changed_since\" is in the shard header but not in the manifest");
}

TEST_CASE("an earlier checkpoint's shard copied under this step's name may hold more tensors too") {
  // A tier that lacked the earlier step's file holds it as "<that step>.<file>".
  Manifest m = SampleManifest();
  m.shards[1].name = "checkpoint_99.shard-00001.safetensors";
  SafetensorsHeader header;
  header.data_start = 4096;
  header.tensors = {{"params/b", DType::kBF16, {32}, 0, 64}, {"changed_since", DType::kF32, {4}, 64, 80}};
  CHECK(CheckShardMatchesManifest(m, 1, header, 4096 + 64).ok());
  CHECK(IsCopyOfEarlierFile("checkpoint_99.shard-00001.safetensors"));
  CHECK(IsCopyOfEarlierFile("checkpoint_1.shard-p00001-00000.safetensors"));
  CHECK_FALSE(IsCopyOfEarlierFile("shard-p00001-00000.safetensors"));
  CHECK_FALSE(IsCopyOfEarlierFile("replica-00000.safetensors"));
}

TEST_CASE("the content hash: XXH3-128, pieces of 8 MiB combined, spelled in 32 hex digits") {
  // XXH3-128 of nothing, as xxHash documents it.
  CHECK(HashToHex(Xxh3(nullptr, 0)) == "99aa06d3014798d86001c324468d497f");
  CHECK(HashFromHex("99AA06D3014798D86001C324468D497F").value() == Xxh3(nullptr, 0));
  std::vector<char> bytes(kHashPiece * 2 + 5);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 131 + (i >> 13));
  const Hash128 pieces[] = {Xxh3(bytes.data(), kHashPiece), Xxh3(bytes.data() + kHashPiece, kHashPiece),
                            Xxh3(bytes.data() + 2 * kHashPiece, 5)};
  CHECK(ContentHash(bytes.data(), bytes.size()) == CombinePieceHashes(pieces));
  const Hash128 before = ContentHash(bytes.data(), bytes.size());
  bytes[kHashPiece + 7] ^= 1;
  CHECK_FALSE(ContentHash(bytes.data(), bytes.size()) == before);
  CHECK(ContentHash(nullptr, 0) == CombinePieceHashes({}));
}

}  // namespace
}  // namespace ckptio::format
