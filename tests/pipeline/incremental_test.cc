// Incremental saves (Options::incremental) on the real file system: only the
// tensors that changed are written, every kept step restores bit-exact,
// retention keeps exactly the files kept steps refer to, and a missing or
// damaged referenced file fails verify naming both steps.

#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptio/checkpoint_manager.h"
#include "format/content_hash.h"
#include "base/dtype.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::unique_ptr<CheckpointManager> OpenOrDie(const std::string& root, const Options& o) {
  auto m = CheckpointManager::Open(root, o);
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  return std::move(m).value();
}

// The LoRA case in small: four frozen 1 MiB tensors (a shard each, with
// 1 MiB shards) and two small trainable ones that change at every step.
struct Lora {
  std::vector<std::string> names;
  std::vector<Bytes> bytes;

  explicit Lora(uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int i = 0; i < 4; ++i) Add("base/layer" + std::to_string(i), 1 << 20, rng);
    for (int i = 0; i < 2; ++i) Add("lora/layer" + std::to_string(i), 16 << 10, rng);
  }
  void Add(std::string name, size_t n, std::mt19937_64& rng) {
    names.push_back(std::move(name));
    Bytes b(n);
    for (auto& x : b) x = static_cast<std::byte>(rng());
    bytes.push_back(std::move(b));
  }
  void Train(int step) {  // the trainable tensors change
    for (size_t i = 4; i < bytes.size(); ++i) {
      for (size_t k = 0; k < bytes[i].size(); k += 97) bytes[i][k] = static_cast<std::byte>(step * 31 + k);
    }
  }
  std::vector<TensorRef> Refs() const {
    std::vector<TensorRef> r;
    for (size_t i = 0; i < names.size(); ++i) r.push_back({names[i], DType::kU8, {bytes[i].size()}, bytes[i].data()});
    return r;
  }
  uint64_t FrozenBytes() const { return 4u << 20; }
};

Options IncrementalOptions(int keep) {
  Options o = testing::SmallOptions(32 << 20);
  o.incremental = true;
  o.keep = keep;
  return o;
}

void CheckRestores(CheckpointManager& m, int64_t step, const Lora& want) {
  auto r = m.Restore(step);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  REQUIRE(r->tensors.size() == want.names.size());
  for (size_t i = 0; i < want.names.size(); ++i) {
    CHECK(r->tensors[i].name == want.names[i]);  // in the caller's order
    CHECK_MESSAGE(r->tensors[i].bytes == want.bytes[i], "step " << step << " tensor " << want.names[i]);
  }
  auto v = m.Verify(step);
  CHECK_MESSAGE(v.ok(), v.status().ToString());
}

std::set<std::string> Files(const std::string& dir) {
  std::set<std::string> out;
  if (!fs::exists(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

uint64_t DirBytes(const std::string& dir) {
  uint64_t n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.file_size();
  return n;
}

const std::set<std::string> kFrozenShards = {"shard-00000.safetensors", "shard-00001.safetensors",
                                             "shard-00002.safetensors", "shard-00003.safetensors"};

TEST_CASE("incremental saves write the changed tensors only, restore bit-exact, and prune what nothing refers to") {
  TempDir dir;
  Lora state(1);
  std::map<int64_t, Lora> saved;
  auto m = OpenOrDie(dir.path(), IncrementalOptions(/*keep=*/2));
  for (int64_t step = 1; step <= 5; ++step) {
    state.Train(static_cast<int>(step));
    const ManagerStats before = m->stats();
    REQUIRE(m->Save(step, state.Refs())->Wait().ok());
    saved.emplace(step, state);
    const ManagerStats after = m->stats();
    if (step == 1) {
      CHECK(after.bytes_reused == 0);
      CHECK(DirBytes(dir / "checkpoint_1") > state.FrozenBytes());
    } else {
      // The frozen megabytes are referenced, not written again.
      CHECK(after.bytes_reused - before.bytes_reused == state.FrozenBytes());
      CHECK(after.bytes_committed - before.bytes_committed < (64u << 10));
      CHECK(DirBytes(dir / ("checkpoint_" + std::to_string(step))) < (64u << 10));
    }
  }
  REQUIRE(m->WaitUntilFinished().ok());
  CHECK(m->AllSteps() == std::vector<int64_t>{4, 5});
  for (int64_t step : {4, 5}) CheckRestores(*m, step, saved.at(step));
  // Step 1 is pruned (no manifest), but the four frozen shards the kept
  // steps refer to stay; its trainable shard and steps 2 and 3 are gone.
  CHECK(Files(dir / "checkpoint_1") == kFrozenShards);
  CHECK_FALSE(fs::exists(dir / "checkpoint_2"));
  CHECK_FALSE(fs::exists(dir / "checkpoint_3"));

  SUBCASE("reopening keeps the referenced files (they are not debris)") {
    m.reset();
    m = OpenOrDie(dir.path(), IncrementalOptions(2));
    CHECK(m->AllSteps() == std::vector<int64_t>{4, 5});
    CHECK(Files(dir / "checkpoint_1") == kFrozenShards);
    for (int64_t step : {4, 5}) CheckRestores(*m, step, saved.at(step));
    // The first save after reopening compares against step 5's manifest.
    state.Train(6);
    REQUIRE(m->Save(6, state.Refs())->Wait().ok());
    CHECK(m->stats().bytes_reused == state.FrozenBytes());
    CheckRestores(*m, 6, state);
  }
  SUBCASE("a frozen tensor that changes is written, and its old shard goes once no kept step needs it") {
    state.bytes[0][12345] ^= std::byte{1};  // one bit of base/layer0
    state.Train(6);
    const ManagerStats before = m->stats();
    REQUIRE(m->Save(6, state.Refs())->Wait().ok());
    CHECK(m->stats().bytes_reused - before.bytes_reused == state.FrozenBytes() - (1u << 20));
    const Lora step6 = state;
    state.Train(7);
    REQUIRE(m->Save(7, state.Refs())->Wait().ok());
    REQUIRE(m->WaitUntilFinished().ok());
    CHECK(m->AllSteps() == std::vector<int64_t>{6, 7});
    // Steps 6 and 7 use step 1's shards 1-3 and step 6's new layer0.
    CHECK(Files(dir / "checkpoint_1") ==
          std::set<std::string>{"shard-00001.safetensors", "shard-00002.safetensors", "shard-00003.safetensors"});
    CheckRestores(*m, 6, step6);
    CheckRestores(*m, 7, state);
  }
  SUBCASE("saving a retired step again is refused, naming the steps that use its files") {
    auto h = m->Save(1, state.Refs());
    REQUIRE(h.ok());
    const Status s = h->Wait();
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK(s.message().find("checkpoint_1 was pruned, but its files are used by steps 4, 5 (incremental saves)") !=
          std::string::npos);
    CHECK(Files(dir / "checkpoint_1") == kFrozenShards);
    m.reset();
    // A manager with overwrite may not replace a step later steps use either.
    Options o = testing::SmallOptions(32 << 20);
    o.overwrite = true;
    auto plain = OpenOrDie(dir.path(), o);
    REQUIRE(plain->Delete(5).ok());  // step 4 still uses checkpoint_1
    REQUIRE(plain->Save(5, state.Refs())->Wait().ok());  // whole, incremental off
    const Status again = plain->Save(1, state.Refs())->Wait();
    CHECK(again.code() == StatusCode::kFailedPrecondition);
    CHECK(again.message().find("used by step 4 ") != std::string::npos);
    CheckRestores(*plain, 4, saved.at(4));
  }
  SUBCASE("deleting every step that refers to a retired checkpoint removes it") {
    REQUIRE(m->Delete(4).ok());
    CHECK(Files(dir / "checkpoint_1") == kFrozenShards);
    CheckRestores(*m, 5, saved.at(5));
    REQUIRE(m->Delete(5).ok());
    CHECK_FALSE(fs::exists(dir / "checkpoint_1"));
    CHECK(m->AllSteps().empty());
  }
}

TEST_CASE("a referenced shard that is missing or damaged fails verify and restore naming both steps") {
  TempDir dir;
  Lora state(2);
  auto m = OpenOrDie(dir.path(), IncrementalOptions(/*keep=*/0));
  for (int64_t step : {10, 20}) {
    state.Train(static_cast<int>(step));
    REQUIRE(m->Save(step, state.Refs())->Wait().ok());
  }
  SUBCASE("missing") {
    fs::remove(dir / "checkpoint_10/shard-00002.safetensors");
    auto v = m->Verify(20);
    REQUIRE_FALSE(v.ok());
    CHECK(v.status().code() == StatusCode::kCorruption);
    CHECK(v.status().message().find(dir / "checkpoint_10/shard-00002.safetensors (used by checkpoint_20): missing") !=
          std::string::npos);
    CHECK_FALSE(m->Restore(20).ok());
  }
  SUBCASE("overwriting the step that stores them is refused") {
    m.reset();
    Options o = testing::SmallOptions(32 << 20);
    o.overwrite = true;
    auto plain = OpenOrDie(dir.path(), o);
    const Status s = plain->Save(10, state.Refs())->Wait();
    CHECK(s.code() == StatusCode::kFailedPrecondition);
    CHECK(s.message().find("checkpoint_10's files are used by step 20 (incremental saves)") != std::string::npos);
    REQUIRE(plain->Verify(20).ok());
  }
  SUBCASE("one flipped byte") {
    const std::string path = dir / "checkpoint_10/shard-00002.safetensors";
    std::string bytes = testing::ReadWholeFile(path);
    bytes[bytes.size() - 100] ^= 1;
    testing::WriteWholeFile(path, bytes);
    auto v = m->Verify(20);
    REQUIRE_FALSE(v.ok());
    CHECK(v.status().message().find("checkpoint_10/shard-00002.safetensors (used by checkpoint_20): tensor "
                                    "\"base/layer2\"") != std::string::npos);
    CHECK(v.status().message().find("CRC32C mismatch") != std::string::npos);
  }
}

TEST_CASE("a tensor renamed, reshaped or retyped with the same bytes is written again") {
  TempDir dir;
  Lora state(3);
  auto m = OpenOrDie(dir.path(), IncrementalOptions(/*keep=*/0));
  REQUIRE(m->Save(1, state.Refs())->Wait().ok());
  std::vector<TensorRef> refs = state.Refs();
  refs[0].name = "base/renamed";
  refs[1].shape = {512, 2048};
  refs[2].dtype = DType::kI8;
  const ManagerStats before = m->stats();
  REQUIRE(m->Save(2, refs)->Wait().ok());
  // Only base/layer3 and the two trainable tensors match step 1.
  CHECK(m->stats().bytes_reused - before.bytes_reused == (1u << 20) + 2 * (16u << 10));
  auto r = m->Restore(2);
  REQUIRE(r.ok());
  CHECK(r->tensors[0].name == "base/renamed");
  CHECK(r->tensors[0].bytes == state.bytes[0]);
  CHECK(r->tensors[1].shape == std::vector<uint64_t>{512, 2048});
  CHECK(r->tensors[2].dtype == DType::kI8);
}

TEST_CASE("the manifest's content hash is the format's definition, whichever pass computes it") {
  // Two 8 MiB pieces and a short one: the pool hashes them separately.
  Bytes bytes(2 * format::kHashPiece + 4100);
  std::mt19937_64 rng(7);
  for (auto& b : bytes) b = static_cast<std::byte>(rng());
  const std::string want = format::HashToHex(format::ContentHash(bytes.data(), bytes.size()));
  struct Mode {
    const char* name;
    SnapshotMode snapshot;
    SnapshotCrc crc;
  };
  for (const Mode& mode : {Mode{"copy, background CRC", SnapshotMode::kCopy, SnapshotCrc::kBackground},
                           Mode{"copy, fused CRC", SnapshotMode::kCopy, SnapshotCrc::kFused},
                           Mode{"borrow", SnapshotMode::kBorrow, SnapshotCrc::kBackground}}) {
    CAPTURE(mode.name);
    TempDir dir;
    Options o = IncrementalOptions(0);
    o.staging_memory = 64 << 20;
    o.snapshot = mode.snapshot;
    o.snapshot_crc = mode.crc;
    auto m = OpenOrDie(dir.path(), o);
    const TensorRef ref{"w", DType::kU8, {bytes.size()}, bytes.data()};
    REQUIRE(m->Save(1, {&ref, 1})->Wait().ok());
    const auto manifest = nlohmann::json::parse(testing::ReadWholeFile(dir / "checkpoint_1/manifest.json"));
    CHECK(manifest["tensors"][0]["xxh3"] == want);
  }
}

TEST_CASE("incremental is refused with overwrite and with multi-host saves") {
  TempDir dir;
  Options o = IncrementalOptions(0);
  o.overwrite = true;
  auto m = CheckpointManager::Open(dir.path(), o);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().message().find("incremental") != std::string::npos);
}

}  // namespace
}  // namespace ckptio
