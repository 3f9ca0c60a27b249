// Names from a checkpoint's manifest or shard headers never take ckptio
// outside the checkpoint directory, through the real file system.
//
// Each case rewrites a committed checkpoint's manifest (or a shard header) so
// that it names a file elsewhere, and first plants a decoy there: a byte-exact
// copy of the real shard. A reader that followed the name would find valid
// bytes with the right CRC32C and restore would succeed, so every case fails
// if the name is ever used. A control case that names a plain decoy inside the
// checkpoint shows that the decoys are good enough to be restored from.
// Restores use a read-only manager, as `ckptio verify`/`export` do; after
// every case nothing outside the checkpoint directory has changed.
//
// GCS reads go through the same reader (storage::Storage::OpenFile after
// format::ParseManifest), so what is refused here is refused for a bucket
// prefix too; deletes on both backends list the step's own directory or
// prefix and never take names from a manifest.

#include <doctest/doctest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "base/dtype.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using testing::ReadWholeFile;
using testing::SmallOptions;
using testing::TempDir;
using testing::WriteWholeFile;

constexpr char kShard[] = "shard-00000.safetensors";
constexpr char kTensor[] = "layer0/w";  // 8 bytes: header patches keep the length

// Every regular file and symlink under `dir` with its contents (or target).
std::map<std::string, std::string> Tree(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_symlink()) {
      out[e.path().string()] = "-> " + fs::read_symlink(e.path()).string();
    } else if (e.is_regular_file()) {
      out[e.path().string()] = ReadWholeFile(e.path().string());
    } else {
      out[e.path().string()] = "<dir>";
    }
  }
  return out;
}

// A root with checkpoint_4 (one tensor, one shard) and decoys of its shard
// wherever a hostile name could point.
class HostileFixture {
 public:
  HostileFixture() {
    fs::create_directories(root_);
    bytes_ = Bytes(4096 * sizeof(float));
    for (size_t i = 0; i < bytes_.size(); ++i) bytes_[i] = static_cast<std::byte>(i * 131 + 7);
    {
      auto m = CheckpointManager::Open(root_, SmallOptions());
      REQUIRE_MESSAGE(m.ok(), m.status().ToString());
      std::vector<TensorRef> refs = {{kTensor, DType::kF32, {64, 64}, bytes_.data()}};
      auto handle = (*m)->Save(4, refs);
      REQUIRE_MESSAGE(handle.ok(), handle.status().ToString());
      Status saved = handle->Wait();
      REQUIRE_MESSAGE(saved.ok(), saved.ToString());
    }
    manifest_text_ = ReadWholeFile(manifest_path());
    shard_bytes_ = ReadWholeFile(checkpoint() + "/" + kShard);
    REQUIRE(!shard_bytes_.empty());
    for (const std::string& decoy : {root_ + "/decoy.safetensors", dir_ / "decoy.safetensors",
                                     dir_ / "abs.safetensors",
                                     checkpoint() + "/sub/decoy.safetensors",
                                     checkpoint() + "/..\\decoy.safetensors"}) {
      fs::create_directories(fs::path(decoy).parent_path());
      WriteWholeFile(decoy, shard_bytes_);
    }
  }

  const std::string& root() const { return root_; }
  std::string outside() const { return dir_.path(); }
  std::string checkpoint() const { return root_ + "/checkpoint_4"; }
  std::string manifest_path() const { return checkpoint() + "/manifest.json"; }
  std::string shard_path() const { return checkpoint() + "/" + kShard; }
  json Manifest() const { return json::parse(manifest_text_); }
  const std::string& shard_bytes() const { return shard_bytes_; }
  const Bytes& tensor_bytes() const { return bytes_; }

  // The manifest with its one shard renamed to `name` everywhere.
  json WithShardName(const std::string& name) const {
    json j = Manifest();
    j["shards"][0]["name"] = name;
    for (json& t : j["tensors"]) t["shard"] = name;
    return j;
  }

  void WriteManifest(const json& j) const { WriteWholeFile(manifest_path(), j.dump(2)); }

  Result<RestoredCheckpoint> RestoreReadOnly() const {
    auto reader = CheckpointManager::OpenReadOnly(root_, SmallOptions());
    REQUIRE_MESSAGE(reader.ok(), reader.status().ToString());
    return (*reader)->Restore(4);
  }

 private:
  TempDir dir_;
  std::string root_ = dir_ / "root";
  Bytes bytes_;
  std::string manifest_text_;
  std::string shard_bytes_;
};

TEST_CASE("a manifest naming a plain decoy in the checkpoint restores from it (the control)") {
  HostileFixture f;
  fs::copy_file(f.root() + "/decoy.safetensors", f.checkpoint() + "/decoy.safetensors");
  fs::remove(f.shard_path());
  f.WriteManifest(f.WithShardName("decoy.safetensors"));
  auto r = f.RestoreReadOnly();
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  REQUIRE(r->tensors.size() == 1);
  CHECK(r->tensors[0].name == kTensor);
  CHECK(r->tensors[0].bytes == f.tensor_bytes());
}

TEST_CASE("a manifest cannot make restore read a shard outside the checkpoint directory") {
  HostileFixture f;
  const std::string abs = f.outside() + "/abs.safetensors";
  const std::string nul_cut = std::string(kShard) + std::string(1, '\0') + "/../../decoy.safetensors";
  // name -> what the refusal says about it
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"../decoy.safetensors", "shard name \"../decoy.safetensors\" is not a plain file name"},
      {"../../decoy.safetensors", "shard name \"../../decoy.safetensors\" is not a plain file name"},
      {abs, "is not a plain file name"},
      {"sub/decoy.safetensors", "shard name \"sub/decoy.safetensors\" is not a plain file name"},
      {"..\\decoy.safetensors", "shard name \"..\\\\decoy.safetensors\" is not a plain file name"},
      // Cut at the NUL, this would open the real shard and restore would succeed.
      {nul_cut, "shard name \"shard-00000.safetensors\\u0000/../../decoy.safetensors\" is not a "
                "plain file name"},
      {"", "shard name is empty"},
      {".", "shard name \".\" is not a plain file name"},
      {"..", "shard name \"..\" is not a plain file name"},
  };
  const auto before = Tree(f.outside());
  for (const auto& [name, problem] : cases) {
    CAPTURE(name);
    f.WriteManifest(f.WithShardName(name));
    auto r = f.RestoreReadOnly();
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kCorruption);
    CHECK(r.status().message().starts_with(f.manifest_path() + ": "));
    CHECK_MESSAGE(r.status().message().find(problem) != std::string::npos, r.status().message());
  }
  // Nothing outside the checkpoint was written, moved or removed.
  auto after = Tree(f.outside());
  after.erase(f.manifest_path());
  auto expected = before;
  expected.erase(f.manifest_path());
  CHECK(after == expected);
}

TEST_CASE("a manifest listing a shard or a tensor twice is refused") {
  HostileFixture f;
  json j = f.Manifest();
  j["shards"].push_back(j["shards"][0]);
  f.WriteManifest(j);
  auto r = f.RestoreReadOnly();
  CHECK(r.status().code() == StatusCode::kCorruption);
  CHECK(r.status().message() ==
        f.manifest_path() + ": shard \"" + kShard + "\" is listed twice");

  j = f.Manifest();
  j["tensors"].push_back(j["tensors"][0]);
  f.WriteManifest(j);
  r = f.RestoreReadOnly();
  CHECK(r.status().code() == StatusCode::kCorruption);
  CHECK(r.status().message() ==
        f.manifest_path() + ": tensor \"" + kTensor + "\" is listed twice");
}

TEST_CASE("hostile tensor names in a manifest are refused") {
  HostileFixture f;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/etc/passwd", "tensor name \"/etc/passwd\" is an absolute path"},
      {"../../w", "tensor name \"../../w\" contains a \"..\" path component"},
      {std::string("layer0/w\0x", 10), "tensor name \"layer0/w\\u0000x\" contains a NUL byte"},
      {"", "tensor name is empty"},
  };
  for (const auto& [name, problem] : cases) {
    CAPTURE(name);
    json j = f.Manifest();
    j["tensors"][0]["name"] = name;
    f.WriteManifest(j);
    auto r = f.RestoreReadOnly();
    CHECK(r.status().code() == StatusCode::kCorruption);
    CHECK(r.status().message() == f.manifest_path() + ": " + problem);
  }
}

TEST_CASE("a shard header naming a tensor with a hostile name is refused naming the shard") {
  HostileFixture f;
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"/etc/pwd", "tensor name \"/etc/pwd\" is an absolute path"},
      {"../../ab", "tensor name \"../../ab\" contains a \"..\" path component"},
      {"w\\u0000x", "tensor name \"w\\u0000x\" contains a NUL byte"},
  };
  for (const auto& [name, problem] : cases) {
    CAPTURE(name);
    std::string shard = f.shard_bytes();
    const std::string quoted = "\"" + std::string(kTensor) + "\"";
    const size_t at = shard.find(quoted);
    REQUIRE(at != std::string::npos);
    // Same length as "layer0/w" (the escape counts as its six characters), so
    // the header length and every offset stay valid.
    std::string replacement = "\"" + name + "\"";
    replacement.resize(quoted.size(), ' ');
    REQUIRE(replacement.size() == quoted.size());
    shard.replace(at, quoted.size(), replacement);
    WriteWholeFile(f.shard_path(), shard);
    auto r = f.RestoreReadOnly();
    CHECK(r.status().code() == StatusCode::kCorruption);
    CHECK_MESSAGE(r.status().message().starts_with(f.shard_path() + ": "), r.status().message());
    CHECK_MESSAGE(r.status().message().find(problem) != std::string::npos, r.status().message());
  }
}

TEST_CASE("restore does not follow a shard that is a symlink out of the checkpoint") {
  HostileFixture f;
  fs::remove(f.shard_path());
  fs::create_symlink(f.outside() + "/decoy.safetensors", f.shard_path());
  auto r = f.RestoreReadOnly();
  REQUIRE_FALSE(r.ok());
  // (The message names the shard relative to the root: "open
  // checkpoint_4/shard-00000.safetensors: Too many levels of symbolic links".)
  CHECK_MESSAGE(r.status().message().find(std::string("checkpoint_4/") + kShard) !=
                    std::string::npos,
                r.status().message());
  CHECK(ReadWholeFile(f.outside() + "/decoy.safetensors") == f.shard_bytes());
}

}  // namespace
}  // namespace ckptio
