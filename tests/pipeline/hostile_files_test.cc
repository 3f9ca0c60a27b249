// What sits where a checkpoint file should be, on the real file system: a
// FIFO, a symbolic link out of the root, a directory, nothing at all, or a
// shard that declares more bytes than the machine has. Every reader answers
// with an error that says what it found (never hangs, never follows a link
// out of the root, never quotes what is outside), with the code the CLI maps
// to "integrity failure"; and a step that another process removes while it
// is read is told apart from a damaged one.

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
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
// What a reader that followed a link out of the root would quote.
constexpr char kSecret[] = "root:x:0:0:secret-outside-the-root";

// A root holding checkpoint_1 and checkpoint_2 (one 64 KiB tensor each), and
// a directory outside it with a secret file.
class Fixture {
 public:
  Fixture() {
    fs::create_directories(root_);
    fs::create_directories(outside_);
    WriteWholeFile(outside_ + "/passwd", kSecret);
    Bytes bytes(64 << 10);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<std::byte>(i * 7 + 1);
    auto m = CheckpointManager::Open(root_, SmallOptions());
    REQUIRE_MESSAGE(m.ok(), m.status().ToString());
    for (int64_t step : {1, 2}) {
      std::vector<TensorRef> refs = {{"w", DType::kU8, {bytes.size()}, bytes.data()}};
      auto h = (*m)->Save(step, refs);
      REQUIRE_MESSAGE(h.ok(), h.status().ToString());
      REQUIRE(h->Wait().ok());
    }
  }
  const std::string& root() const { return root_; }
  const std::string& outside() const { return outside_; }
  std::string step(int64_t s) const { return root_ + "/checkpoint_" + std::to_string(s); }

  std::unique_ptr<CheckpointManager> Reader() const {
    auto r = CheckpointManager::OpenReadOnly(root_, SmallOptions());
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    return std::move(r).value();
  }

 private:
  TempDir dir_;
  std::string root_ = dir_ / "root";
  std::string outside_ = dir_ / "outside";
};

// Info, Verify and Restore of `step` all fail with Corruption whose message
// contains `want` and never the secret.
void CheckEveryReaderRefuses(CheckpointManager& m, int64_t step, const std::string& want) {
  auto info = m.Info(step);
  auto verify = m.Verify(step);
  auto restore = m.Restore(step);
  for (const Status& s : {info.status(), verify.status(), restore.status()}) {
    CAPTURE(s.ToString());
    CHECK(s.code() == StatusCode::kCorruption);
    CHECK(s.message().find(want) != std::string::npos);
    CHECK(s.message().find("secret") == std::string::npos);
  }
}

TEST_CASE("a FIFO named manifest.json is refused at once, not waited on") {
  Fixture f;
  fs::remove(f.step(2) + "/manifest.json");
  REQUIRE(::mkfifo((f.step(2) + "/manifest.json").c_str(), 0644) == 0);
  auto reader = f.Reader();
  CheckEveryReaderRefuses(*reader, 2, f.step(2) + "/manifest.json: a FIFO where a checkpoint file should be");
  auto writer = CheckpointManager::Open(f.root(), SmallOptions());
  REQUIRE(writer.ok());
  CheckEveryReaderRefuses(**writer, 2, "a FIFO");
  CHECK((*writer)->Verify(1).ok());  // the other step is untouched
}

TEST_CASE("a step directory renamed to another step is refused by every reader: its manifest names the step it is") {
  Fixture f;
  fs::rename(f.step(2), f.step(7));
  auto reader = f.Reader();
  REQUIRE(reader->AllSteps() == std::vector<int64_t>{1, 7});
  CheckEveryReaderRefuses(*reader, 7, f.step(7) + "/manifest.json: says step 2, but the directory is step 7");
  CHECK(reader->Verify(1).ok());
}

TEST_CASE("a FIFO in place of a shard is refused at once") {
  Fixture f;
  fs::remove(f.step(2) + "/" + kShard);
  REQUIRE(::mkfifo((f.step(2) + "/" + kShard).c_str(), 0644) == 0);
  auto reader = f.Reader();
  auto verify = reader->Verify(2);
  CHECK(verify.status().code() == StatusCode::kCorruption);
  CHECK(verify.status().message().find(std::string(kShard) + ": a FIFO") != std::string::npos);
}

TEST_CASE("a manifest.json linked to a file outside the root is not read, and its bytes are not quoted") {
  Fixture f;
  fs::remove(f.step(2) + "/manifest.json");
  fs::create_symlink(f.outside() + "/passwd", f.step(2) + "/manifest.json");
  auto reader = f.Reader();
  CheckEveryReaderRefuses(*reader, 2, f.step(2) + "/manifest.json: a symbolic link");
}

TEST_CASE("a shard linked to a copy of itself outside the root is not read") {
  Fixture f;
  const std::string shard = f.step(2) + "/" + kShard;
  fs::copy_file(shard, f.outside() + "/copy.safetensors");
  fs::remove(shard);
  fs::create_symlink(f.outside() + "/copy.safetensors", shard);
  auto reader = f.Reader();
  auto restore = reader->Restore(2);
  CHECK(restore.status().code() == StatusCode::kCorruption);
  CHECK(restore.status().message().find(shard + ": a symbolic link") != std::string::npos);
}

TEST_CASE("a step directory linked to a checkpoint outside the root is not a step of this root") {
  Fixture f;
  fs::rename(f.step(2), f.outside() + "/checkpoint_2");
  fs::create_directory_symlink(f.outside() + "/checkpoint_2", f.step(2));
  auto reader = f.Reader();
  CHECK(reader->AllSteps() == std::vector<int64_t>{1});
}

TEST_CASE("a directory where manifest.json should be, and a missing shard, are integrity failures") {
  Fixture f;
  fs::remove(f.step(1) + "/manifest.json");
  fs::create_directory(f.step(1) + "/manifest.json");
  fs::remove(f.step(2) + "/" + kShard);
  auto reader = f.Reader();
  CheckEveryReaderRefuses(*reader, 1, f.step(1) + "/manifest.json: a directory where a checkpoint file should be");
  auto verify = reader->Verify(2);
  CHECK(verify.status().code() == StatusCode::kCorruption);
  CHECK(verify.status().message().find(f.step(2) + "/" + kShard) != std::string::npos);
}

TEST_CASE("a .ckptio.lock linked out of the root stops the writer, and its target is not created") {
  Fixture f;
  fs::remove(f.root() + "/.ckptio.lock");
  fs::create_symlink(f.outside() + "/created-by-ckptio", f.root() + "/.ckptio.lock");
  auto writer = CheckpointManager::Open(f.root(), SmallOptions());
  REQUIRE_FALSE(writer.ok());
  CHECK(writer.status().code() == StatusCode::kFailedPrecondition);
  CHECK(writer.status().message().find(f.root() + "/.ckptio.lock is a symbolic link") != std::string::npos);
  CHECK_FALSE(fs::exists(f.outside() + "/created-by-ckptio"));
}

TEST_CASE("a .recycle linked out of the root never receives pruned shards") {
  Fixture f;
  const std::string bin = f.outside() + "/bin";
  fs::create_directory(bin);
  fs::create_directory_symlink(bin, f.root() + "/.recycle");
  Options o = SmallOptions();
  o.keep = 1;
  o.io.recycle = true;
  auto writer = CheckpointManager::Open(f.root(), o);
  REQUIRE_MESSAGE(writer.ok(), writer.status().ToString());
  Bytes bytes(64 << 10, std::byte{3});
  for (int64_t step : {3, 4, 5}) {
    std::vector<TensorRef> refs = {{"w", DType::kU8, {bytes.size()}, bytes.data()}};
    auto h = (*writer)->Save(step, refs);
    REQUIRE(h.ok());
    REQUIRE(h->Wait().ok());
  }
  REQUIRE((*writer)->WaitUntilFinished().ok());
  CHECK((*writer)->AllSteps() == std::vector<int64_t>{5});
  CHECK(fs::is_empty(bin));
  CHECK((*writer)->Verify(5).ok());
}

TEST_CASE("a tensor declared larger than the machine's memory is ResourceExhausted naming it, not bad_alloc") {
  Fixture f;
  // A consistent checkpoint whose one tensor is 1 TiB: a sparse shard of the
  // declared size, a header and a manifest that agree with it.
  const uint64_t huge = uint64_t{1} << 40;
  json header = {{"w", {{"dtype", "U8"}, {"shape", {huge}}, {"data_offsets", {0, huge}}}}};
  std::string text = header.dump();
  text.resize(4096 - 8, ' ');
  std::string prefix(8, '\0');
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  const std::string shard = f.step(2) + "/" + kShard;
  WriteWholeFile(shard, prefix + text);
  fs::resize_file(shard, 4096 + huge);
  json m = json::parse(ReadWholeFile(f.step(2) + "/manifest.json"));
  m["shards"][0]["bytes"] = 4096 + huge;
  m["tensors"][0]["bytes"] = huge;
  m["tensors"][0]["shape"] = {huge};
  WriteWholeFile(f.step(2) + "/manifest.json", m.dump());
  auto reader = f.Reader();
  auto restore = reader->Restore(2);
  CAPTURE(restore.status().ToString());
  CHECK(restore.status().code() == StatusCode::kResourceExhausted);
  CHECK(restore.status().message().find("tensor \"w\" alone is 1.00 TiB") != std::string::npos);
  CHECK(restore.status().message().find(f.step(2)) != std::string::npos);
}

TEST_CASE("a step another process removes while a reader holds the listing is NotFound, saying so") {
  Fixture f;
  auto reader = f.Reader();
  REQUIRE(reader->AllSteps() == std::vector<int64_t>{1, 2});
  {
    auto writer = CheckpointManager::Open(f.root(), SmallOptions());
    REQUIRE(writer.ok());
    REQUIRE((*writer)->Delete(1).ok());
  }
  auto verify = reader->Verify(1);
  CHECK(verify.status().code() == StatusCode::kNotFound);
  CHECK(verify.status().message().find("step 1 in " + f.root() +
                                      " was removed (pruned or deleted) while it was being read") != std::string::npos);
  // The reader's listing is up to date now: the step is simply not there.
  CHECK(reader->AllSteps() == std::vector<int64_t>{2});
  CHECK(reader->Info(1).status().code() == StatusCode::kNotFound);
  CHECK(reader->Verify(2).ok());
}

}  // namespace
}  // namespace ckptio
