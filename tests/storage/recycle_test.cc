// io.recycle: a prune moves the shards of the checkpoint it drops into
// <root>/.recycle, and the next save writes its shards into those files
// (the same inodes) instead of allocating new ones; on the real file system.

#include <doctest/doctest.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

std::set<ino_t> ShardInodes(const std::string& dir) {
  std::set<ino_t> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    struct stat st;
    REQUIRE(::stat(e.path().c_str(), &st) == 0);
    out.insert(st.st_ino);
  }
  return out;
}

size_t Files(const std::string& dir) {
  if (!fs::exists(dir)) return 0;
  return static_cast<size_t>(std::distance(fs::directory_iterator(dir), fs::directory_iterator()));
}

Options RecycleOptions() {
  Options o = testing::SmallOptions(32 << 20);
  o.keep = 2;
  return o;
}

void SaveStep(CheckpointManager& m, int64_t step, size_t tensors, uint64_t elems) {
  auto ts = testing::MakeState(step, tensors, elems);
  auto h = m.Save(step, testing::Refs(ts));
  REQUIRE_MESSAGE(h.ok(), h.status().ToString());
  Status s = h->Wait();
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  // The prune after the commit too, so the next save finds the bin filled.
  s = m.WaitUntilFinished();
  REQUIRE_MESSAGE(s.ok(), s.ToString());
}

void CheckRestores(CheckpointManager& m, int64_t step, size_t tensors, uint64_t elems) {
  const auto want = testing::MakeState(step, tensors, elems);
  auto r = m.Restore(step);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  REQUIRE(r->tensors.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) CHECK_MESSAGE(r->tensors[i].bytes == want[i].bytes, "step " << step);
  auto v = m.Verify(step);
  CHECK_MESSAGE(v.ok(), v.status().ToString());
}

TEST_CASE("a save writes its shards into the files of the checkpoint the last prune dropped") {
  TempDir dir;
  auto m = CheckpointManager::Open(dir.path(), RecycleOptions());
  REQUIRE(m.ok());
  // 4 tensors of 256K F32 (1 MiB): 4 shards per checkpoint.
  std::vector<std::set<ino_t>> inodes;
  for (int64_t step = 1; step <= 5; ++step) {
    SaveStep(**m, step, 4, 256 * 1024);
    inodes.push_back(ShardInodes(dir / ("checkpoint_" + std::to_string(step))));
    REQUIRE(inodes.back().size() == 4);
  }
  // Save 3's commit pruned step 1 into the bin; save 4 took those files, and
  // save 5 took step 2's.
  CHECK(inodes[3] == inodes[0]);
  CHECK(inodes[4] == inodes[1]);
  // Save 5's prune put step 3's shards in the bin, nothing else.
  CHECK(Files(dir / ".recycle") == 4);
  CHECK((*m)->AllSteps() == std::vector<int64_t>{4, 5});
  CHECK_FALSE(fs::exists(dir / "checkpoint_3"));
  for (int64_t step : {4, 5}) CheckRestores(**m, step, 4, 256 * 1024);
}

// Every shard file of `step` holds exactly what its header says, no more.
void CheckShardSizes(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    const std::string bytes = testing::ReadWholeFile(e.path());
    REQUIRE(bytes.size() >= 8);
    const uint64_t header = *reinterpret_cast<const uint64_t*>(bytes.data());
    const std::string json = bytes.substr(8, header);
    uint64_t end = 0;  // the last tensor's end
    for (size_t p = json.find("\"data_offsets\""); p != std::string::npos; p = json.find("\"data_offsets\"", p + 1)) {
      end = std::max<uint64_t>(end, std::stoull(json.substr(json.find(',', p) + 1)));
    }
    CHECK_MESSAGE(bytes.size() == 8 + header + end, e.path().string());
  }
}

TEST_CASE("a recycled file longer than the new shard is cut to its size, and a shorter one grows") {
  TempDir dir;
  auto m = CheckpointManager::Open(dir.path(), RecycleOptions());
  REQUIRE(m.ok());
  struct Save {
    int64_t step;
    size_t tensors;
    uint64_t elems;  // F32 each; one tensor per shard at these sizes
  };
  // 2 MiB tensors, then 1 MiB ones (shards of whole 4 KiB blocks, so no
  // padded write cuts them anyway), then odd ones, then 2 MiB again: each
  // save from the 2nd on writes into the files of the save two before.
  const std::vector<Save> saves{{1, 3, 512 * 1024}, {2, 3, 512 * 1024}, {3, 3, 256 * 1024},
                                {4, 3, 256 * 1024}, {5, 3, 1000},       {6, 3, 512 * 1024}};
  for (const Save& sv : saves) {
    SaveStep(**m, sv.step, sv.tensors, sv.elems);
    CheckShardSizes(dir / ("checkpoint_" + std::to_string(sv.step)));
  }
  for (const Save& sv : saves) {
    if (sv.step >= 5) CheckRestores(**m, sv.step, sv.tensors, sv.elems);
  }
}

TEST_CASE("with io.recycle false, and for Delete, pruned files are deleted") {
  TempDir dir;
  Options o = RecycleOptions();
  o.io.recycle = false;
  {
    auto m = CheckpointManager::Open(dir.path(), o);
    REQUIRE(m.ok());
    for (int64_t step = 1; step <= 4; ++step) SaveStep(**m, step, 2, 256 * 1024);
    CHECK((*m)->AllSteps() == std::vector<int64_t>{3, 4});
  }
  CHECK_FALSE(fs::exists(dir / ".recycle"));
  // Delete frees the space even when recycling is on.
  auto m = CheckpointManager::Open(dir.path(), RecycleOptions());
  REQUIRE(m.ok());
  REQUIRE((*m)->Delete(3).ok());
  CHECK_FALSE(fs::exists(dir / "checkpoint_3"));
  CHECK(Files(dir / ".recycle") == 0);
}

TEST_CASE("a pruned shard that another name or an open file still holds keeps its bytes") {
  TempDir dir;
  auto m = CheckpointManager::Open(dir.path(), RecycleOptions());
  REQUIRE(m.ok());
  for (int64_t step = 1; step <= 2; ++step) SaveStep(**m, step, 2, 256 * 1024);
  // A backup of shard 0 made with a hard link, and a reader (another open
  // file; in another process it would be the same) holding shard 1.
  const std::string shard0 = dir / "checkpoint_1/shard-00000.safetensors";
  const std::string shard1 = dir / "checkpoint_1/shard-00001.safetensors";
  const std::string backup = dir / "backup-shard-00000.safetensors";
  fs::create_hard_link(shard0, backup);
  const std::string backup_bytes = testing::ReadWholeFile(backup);
  const std::string held_bytes = testing::ReadWholeFile(shard1);
  int held = ::open(shard1.c_str(), O_RDONLY | O_CLOEXEC);
  REQUIRE(held >= 0);
  for (int64_t step = 3; step <= 6; ++step) SaveStep(**m, step, 2, 256 * 1024);
  CHECK(testing::ReadWholeFile(backup) == backup_bytes);
  std::string now(held_bytes.size(), '\0');
  CHECK(::pread(held, now.data(), now.size(), 0) == static_cast<ssize_t>(now.size()));
  ::close(held);
  CHECK(now == held_bytes);
  for (int64_t step : {5, 6}) CheckRestores(**m, step, 2, 256 * 1024);
}

TEST_CASE("a new writer takes the files an earlier one left in the bin") {
  TempDir dir;
  std::set<ino_t> pruned;
  {
    auto m = CheckpointManager::Open(dir.path(), RecycleOptions());
    REQUIRE(m.ok());
    for (int64_t step = 1; step <= 2; ++step) SaveStep(**m, step, 2, 256 * 1024);
    pruned = ShardInodes(dir / "checkpoint_1");
    SaveStep(**m, 3, 2, 256 * 1024);  // prunes 1 into the bin
  }
  CHECK(Files(dir / ".recycle") == 2);
  auto m = CheckpointManager::Open(dir.path(), RecycleOptions());
  REQUIRE(m.ok());
  SaveStep(**m, 4, 2, 256 * 1024);
  CHECK(ShardInodes(dir / "checkpoint_4") == pruned);
  for (int64_t step : {3, 4}) CheckRestores(**m, step, 2, 256 * 1024);
}

}  // namespace
}  // namespace ckptio
