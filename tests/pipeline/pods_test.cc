// Two tiers in a multi-host job (a pod): every host has a local tier of its
// own and the hosts share the remote tier (here a directory; the GCS
// emulator in tests/python/test_py_pods.py). The processes are managers of
// this one process, each with its own local root, meeting at an in-process
// barrier that can all-gather (the role MPI or jax's key-value store plays
// across machines).
//
// The state is LoRA-shaped: a large frozen array and a small trainable one,
// each split by rows between the processes, a scalar process 0 writes, and a
// replicated array the processes split, each holding the other's half as a
// local copy.

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "in_process_barrier.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kCols = 256;         // F32: 1 KiB rows
constexpr uint64_t kBaseRows = 256;     // per process: 256 KiB frozen
constexpr uint64_t kLoraRows = 16;      // per process: 16 KiB trained
constexpr uint64_t kSharedRows = 32;    // replicated, split in halves

struct Chunk {
  testing::OwnedTensor tensor;
  ChunkOf of;
  bool local_copy = false;
  TensorRef ref() const {
    TensorRef r = tensor.ref();
    r.chunk = of;
    r.local_copy = local_copy;
    return r;
  }
};

// Rows [first, first + rows) of `array` (global rows `total`): its bytes a
// function of its name and `version`.
Chunk Rows(const std::string& array, uint64_t total, uint64_t first, uint64_t rows, int64_t version) {
  std::string name = ChunkName(array, {first, 0});
  return {testing::MakeTensor(name, DType::kF32, {rows, kCols}, version), {array, {total, kCols}, {first, 0}}, false};
}

// What process p of `count` saves at `step`.
std::vector<Chunk> StateOf(int p, int count, int64_t step) {
  std::vector<Chunk> out;
  const uint64_t n = static_cast<uint64_t>(count);
  out.push_back(Rows("base", n * kBaseRows, p * kBaseRows, kBaseRows, /*frozen*/ 0));
  out.push_back(Rows("lora", n * kLoraRows, p * kLoraRows, kLoraRows, step));
  // The replicated array: each process owns a part, and holds the others'.
  const uint64_t part = kSharedRows / n;
  for (int q = 0; q < count; ++q) {
    out.push_back(Rows("shared", kSharedRows, q * part, part, 0));
    out.back().local_copy = q != p;
  }
  Chunk step_scalar{testing::MakeTensor("step", DType::kI64, {}, step), {}, p != 0};
  out.push_back(std::move(step_scalar));
  return out;
}

Options PodOptions(const std::string& remote, int p, int count) {
  Options o = testing::SmallOptions(uint64_t{4} << 20);
  o.keep = 2;
  o.incremental = true;
  o.tiers.remote = remote;
  o.tiers.remote_keep = 3;
  o.multihost.process_index = p;
  o.multihost.process_count = count;
  o.multihost.timeout = std::chrono::milliseconds(30000);
  return o;
}

std::string HostRoot(const testing::TempDir& dir, int p) { return dir / ("host" + std::to_string(p)); }

// The processes' managers, opened at once (Open swaps the local steps).
std::vector<std::unique_ptr<CheckpointManager>> OpenPod(const testing::TempDir& dir, int count,
                                                        bool seed_local = false) {
  auto barriers = testing::InProcessAllGatherBarriers(count);
  std::vector<std::optional<Result<std::unique_ptr<CheckpointManager>>>> opened(count);
  std::vector<std::thread> threads;
  for (int p = 0; p < count; ++p) {
    Options o = PodOptions(dir / "remote", p, count);
    o.tiers.seed_local = seed_local;
    threads.emplace_back([&opened, &dir, &barriers, o, p] {
      opened[p].emplace(CheckpointManager::Open(HostRoot(dir, p), o, barriers[p]));
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<std::unique_ptr<CheckpointManager>> out;
  for (int p = 0; p < count; ++p) {
    Result<std::unique_ptr<CheckpointManager>>& m = *opened[p];
    REQUIRE_MESSAGE(m.ok(), "process " << p << ": " << m.status().ToString());
    out.push_back(std::move(m).value());
  }
  return out;
}

// Every process saves its state of `step`; the final statuses by process.
std::vector<Status> SaveAll(std::vector<std::unique_ptr<CheckpointManager>>& pod, int64_t step) {
  const int count = static_cast<int>(pod.size());
  std::vector<std::vector<Chunk>> states;
  std::vector<SaveHandle> handles;
  for (int p = 0; p < count; ++p) {
    states.push_back(StateOf(p, count, step));
    std::vector<TensorRef> refs;
    for (const Chunk& c : states.back()) refs.push_back(c.ref());
    auto h = pod[p]->Save(step, refs, R"({"epoch": 1})");
    REQUIRE_MESSAGE(h.ok(), "process " << p << ": " << h.status().ToString());
    handles.push_back(*h);
  }
  std::vector<Status> out;
  for (const SaveHandle& h : handles) out.push_back(h.Wait());
  return out;
}

// Process p reads back everything its state holds, by name; bit-exact.
void CheckRestores(CheckpointManager& m, int p, int count, int64_t step) {
  std::vector<Chunk> want = StateOf(p, count, step);
  std::vector<Bytes> got(want.size());
  std::vector<MutableTensorRef> into;
  for (size_t i = 0; i < want.size(); ++i) {
    got[i].resize(want[i].tensor.bytes.size());
    into.push_back({want[i].tensor.name, want[i].tensor.dtype, want[i].tensor.shape, got[i].data()});
  }
  auto r = m.RestoreInto(step, into);
  REQUIRE_MESSAGE(r.ok(), "process " << p << ": " << r.status().ToString());
  for (size_t i = 0; i < want.size(); ++i) {
    CAPTURE(want[i].tensor.name);
    CHECK(got[i] == want[i].tensor.bytes);
  }
}

// Bytes of the files a step directory holds itself (manifests and indexes
// aside).
uint64_t DataBytes(const std::string& dir) {
  uint64_t n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".safetensors") n += e.file_size();
  }
  return n;
}

TEST_CASE("two hosts with two tiers: each step commits on both local tiers with one manifest, then once remotely") {
  testing::TempDir dir;
  {
    auto pod = OpenPod(dir, 2);
    for (int64_t step = 1; step <= 3; ++step) {
      for (const Status& s : SaveAll(pod, step)) CHECK_MESSAGE(s.ok(), s.ToString());
    }
    for (auto& m : pod) {
      Status s = m->WaitUntilFinished(CheckpointManager::Tier::kRemote);
      CHECK_MESSAGE(s.ok(), s.ToString());
    }
    for (int p = 0; p < 2; ++p) {
      CHECK(pod[p]->AllSteps(CheckpointManager::Tier::kLocal) == std::vector<int64_t>{2, 3});  // keep 2
      CHECK(pod[p]->AllSteps(CheckpointManager::Tier::kRemote) == std::vector<int64_t>{1, 2, 3});
      CHECK(pod[p]->stats().bytes_read_remote == 0);
    }
  }
  // One manifest, the same bytes on every host, naming both processes' files.
  const std::string m0 = testing::ReadWholeFile(HostRoot(dir, 0) + "/checkpoint_3/manifest.json");
  CHECK(m0 == testing::ReadWholeFile(HostRoot(dir, 1) + "/checkpoint_3/manifest.json"));
  CHECK(m0.find("shard-p00000-") != std::string::npos);
  CHECK(m0.find("shard-p00001-") != std::string::npos);
  CHECK(m0.find("replica-") == std::string::npos);  // local copies stay local
  // Each host holds its own files and its local copies, not the other's.
  CHECK(fs::exists(HostRoot(dir, 1) + "/checkpoint_3/local-part.json"));
  for (const auto& e : fs::directory_iterator(HostRoot(dir, 1) + "/checkpoint_3")) {
    CHECK(e.path().filename().string().find("p00000") == std::string::npos);
  }
  // Incremental: a later step writes only what changed (the trainable rows,
  // the step scalar, their headers), on every tier.
  const uint64_t changed_per_host = kLoraRows * kCols * 4 + 8;
  for (const std::string& where : {HostRoot(dir, 0), HostRoot(dir, 1)}) {
    CAPTURE(where);
    const uint64_t written = DataBytes(where + "/checkpoint_3");
    CHECK(written >= changed_per_host);
    CHECK(written <= changed_per_host + 2 * 4096);  // headers padded to 4 KiB
  }
  const uint64_t remote_written = DataBytes(dir / "remote/checkpoint_3");
  CHECK(remote_written >= 2 * kLoraRows * kCols * 4 + 8);
  CHECK(remote_written <= 2 * kLoraRows * kCols * 4 + 8 + 2 * 4096);
  // Each reads its state back from its own disk, nothing from the remote tier.
  auto pod = OpenPod(dir, 2);
  for (int p = 0; p < 2; ++p) {
    CheckRestores(*pod[p], p, 2, 3);
    CHECK(pod[p]->stats().bytes_read_remote == 0);
    auto v = pod[p]->Verify(3);
    CHECK_MESSAGE(v.ok(), v.status().ToString());
  }
  // The remote tier alone is a whole checkpoint.
  auto remote = CheckpointManager::OpenReadOnly(dir / "remote", {});
  REQUIRE(remote.ok());
  CHECK((*remote)->Verify(3).ok());
  CHECK((*remote)->Verify(1).ok());
}

TEST_CASE("a host whose local tier is gone reads from the remote tier while the others read locally, then seeds its part") {
  testing::TempDir dir;
  {
    auto pod = OpenPod(dir, 2);
    for (int64_t step = 1; step <= 2; ++step) {
      for (const Status& s : SaveAll(pod, step)) CHECK_MESSAGE(s.ok(), s.ToString());
    }
    for (auto& m : pod) CHECK(m->WaitUntilFinished(CheckpointManager::Tier::kRemote).ok());
  }
  // Step 2 refers to step 1's files in the remote tier too: process 1 waited
  // for step 1's commit there rather than send its file again as step 2's.
  for (const auto& e : fs::directory_iterator(dir / "remote/checkpoint_2")) {
    CHECK(e.path().filename().string().find("checkpoint_1.") == std::string::npos);
  }
  fs::remove_all(HostRoot(dir, 1));  // a replaced machine
  {
    auto pod = OpenPod(dir, 2);
    for (int p = 0; p < 2; ++p) {
      CHECK(pod[p]->LatestStep() == 2);
      CheckRestores(*pod[p], p, 2, 2);
    }
    CHECK(pod[0]->stats().bytes_read_remote == 0);
    // Process 1 read all it holds (its rows, the other half of the shared
    // array, the scalar: its local copies went with the disk) remotely.
    CHECK(pod[1]->stats().bytes_read_remote >= (kBaseRows + kLoraRows + kSharedRows) * kCols * 4 + 8);
  }
  // With seed_local, it copies its part of the newest step back.
  auto pod = OpenPod(dir, 2, /*seed_local=*/true);
  CHECK(pod[1]->WaitUntilFinished(CheckpointManager::Tier::kRemote).ok());
  CHECK(pod[1]->stats().steps_seeded == 1);
  CHECK(fs::exists(HostRoot(dir, 1) + "/checkpoint_2/manifest.json"));
  CHECK(fs::exists(HostRoot(dir, 1) + "/checkpoint_2/local-part.json"));
}

TEST_CASE("a local copy whose manifest differs from the remote tier's is not trusted: the step is read remotely") {
  testing::TempDir dir;
  {
    auto pod = OpenPod(dir, 2);
    for (const Status& s : SaveAll(pod, 1)) CHECK(s.ok());
    for (auto& m : pod) CHECK(m->WaitUntilFinished(CheckpointManager::Tier::kRemote).ok());
  }
  // Host 1's copy of the manifest now lists another CRC for a tensor of host 0's (as a save of
  // the step whose copy never reached the remote tier would).
  const std::string path = HostRoot(dir, 1) + "/checkpoint_1/manifest.json";
  std::string manifest = testing::ReadWholeFile(path);
  const std::string key = "\"name\":\"base@0,0\"";
  const size_t at = manifest.find("\"crc32c\":\"", manifest.find(key)) + 10;
  manifest[at] = manifest[at] == '0' ? '1' : '0';
  std::ofstream(path, std::ios::binary | std::ios::trunc) << manifest;
  auto pod = OpenPod(dir, 2);
  for (int p = 0; p < 2; ++p) CheckRestores(*pod[p], p, 2, 1);
  CHECK(pod[0]->stats().bytes_read_remote == 0);
  CHECK(pod[1]->stats().bytes_read_remote >= (kBaseRows + kLoraRows + kSharedRows) * kCols * 4);
}

TEST_CASE("a host that cannot copy its part: the step is not committed remotely and the error names the host") {
  testing::TempDir dir;
  auto pod = OpenPod(dir, 2);
  for (const Status& s : SaveAll(pod, 1)) CHECK(s.ok());
  for (auto& m : pod) CHECK(m->WaitUntilFinished(CheckpointManager::Tier::kRemote).ok());
  // Where process 1's file of step 2 would go, a directory: its copy fails.
  fs::create_directories(dir / "remote/checkpoint_2.tmp-shared/shard-p00001-00000.safetensors");
  for (const Status& s : SaveAll(pod, 2)) CHECK(s.ok());  // committed locally on both
  Status leader = pod[0]->WaitUntilFinished(CheckpointManager::Tier::kRemote);
  Status other = pod[1]->WaitUntilFinished(CheckpointManager::Tier::kRemote);
  CHECK_FALSE(leader.ok());
  CHECK_MESSAGE(leader.message().find("process 1 failed to write its part of step 2") != std::string::npos,
                leader.ToString());
  CHECK_FALSE(other.ok());
  CHECK_FALSE(fs::exists(dir / "remote/checkpoint_2/manifest.json"));
  CHECK(pod[0]->AllSteps(CheckpointManager::Tier::kRemote) == std::vector<int64_t>{1});
  // The local tiers have step 2, and it restores on both.
  for (int p = 0; p < 2; ++p) CheckRestores(*pod[p], p, 2, 2);
}

TEST_CASE("with a barrier that can only wait, the hosts swap their parts through the remote tier") {
  testing::TempDir dir;
  std::vector<std::unique_ptr<CheckpointManager>> pod;
  {
    auto barrier = testing::InProcessBarrier(2);
    std::vector<std::optional<Result<std::unique_ptr<CheckpointManager>>>> opened(2);
    std::vector<std::thread> threads;
    for (int p = 0; p < 2; ++p) {
      threads.emplace_back([&opened, &dir, &barrier, p] {
        opened[p].emplace(CheckpointManager::Open(HostRoot(dir, p), PodOptions(dir / "remote", p, 2), barrier));
      });
    }
    for (std::thread& t : threads) t.join();
    for (int p = 0; p < 2; ++p) {
      REQUIRE_MESSAGE(opened[p]->ok(), opened[p]->status().ToString());
      pod.push_back(std::move(*opened[p]).value());
    }
  }
  for (int64_t step = 1; step <= 2; ++step) {
    for (const Status& s : SaveAll(pod, step)) CHECK_MESSAGE(s.ok(), s.ToString());
  }
  for (auto& m : pod) CHECK(m->WaitUntilFinished(CheckpointManager::Tier::kRemote).ok());
  CHECK(testing::ReadWholeFile(HostRoot(dir, 0) + "/checkpoint_2/manifest.json") ==
        testing::ReadWholeFile(HostRoot(dir, 1) + "/checkpoint_2/manifest.json"));
  for (int p = 0; p < 2; ++p) CheckRestores(*pod[p], p, 2, 2);
  // Each process removed its part once all had read it.
  CHECK(fs::is_empty(dir / "remote/.ckptio-exchange.tmp-shared"));
}

TEST_CASE("the storage-only fallback cannot order the swaps: refused at open, naming what to give") {
  testing::TempDir dir;
  auto m = CheckpointManager::Open(HostRoot(dir, 0), PodOptions(dir / "remote", 0, 2), nullptr);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().code() == StatusCode::kInvalidArgument);
  CHECK(m.status().message().find("storage-only fallback cannot order") != std::string::npos);
  CHECK(m.status().message().find("MpiBarrier()") != std::string::npos);
}

TEST_CASE("local_copy outside a multi-host job with two tiers is refused, naming the tensor") {
  testing::TempDir dir;
  auto m = CheckpointManager::Open(dir.path(), testing::SmallOptions());
  REQUIRE(m.ok());
  testing::OwnedTensor t = testing::MakeTensor("w", DType::kF32, {4}, 1);
  TensorRef ref = t.ref();
  ref.local_copy = true;
  auto h = (*m)->Save(1, std::span<const TensorRef>(&ref, 1));
  REQUIRE_FALSE(h.ok());
  CHECK(h.status().message().find("tensor \"w\": local_copy is for multi-host saves with two tiers") !=
        std::string::npos);
}

}  // namespace
}  // namespace ckptio
