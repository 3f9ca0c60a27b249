// Multi-host saves with the storage-only barrier: N processes
// (tests/tools/multihost_worker) each save their part; process 0 commits one
// checkpoint; it restores by name on another process count. One process dying
// mid-save: no manifest appears, the others fail clearly within the timeout,
// the previous checkpoint still restores. Chunks of one array saved by
// different processes: managers in this process, one per process_index.

#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ckptio/barrier.h"
#include "ckptio/checkpoint_manager.h"
#include "in_process_barrier.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;

struct Run {
  int status = 0;
  std::string out;
};

// Starts `count` workers with the given arguments (INDEX and COUNT filled
// in) and waits for all of them.
std::vector<Run> RunWorkers(const std::string& mode, const std::string& root, int count,
                            const std::vector<std::string>& rest) {
  const char* exe = std::getenv("CKPTIO_MULTIHOST_WORKER");
  REQUIRE_MESSAGE(exe != nullptr, "CKPTIO_MULTIHOST_WORKER must name the multihost_worker binary");
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (int i = 0; i < count; ++i) {
    int p[2];
    REQUIRE(pipe(p) == 0);
    pid_t pid = fork();
    if (pid == 0) {
      dup2(p[1], STDOUT_FILENO);
      close(p[0]);
      std::vector<std::string> args = {exe, mode, root, std::to_string(i), std::to_string(count)};
      args.insert(args.end(), rest.begin(), rest.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(exe, argv.data());
      _exit(127);
    }
    close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }
  std::vector<Run> runs(count);
  for (int i = 0; i < count; ++i) {
    char buf[4096];
    ssize_t n;
    while ((n = read(fds[i], buf, sizeof buf)) > 0) runs[i].out.append(buf, static_cast<size_t>(n));
    close(fds[i]);
    waitpid(pids[i], &runs[i].status, 0);
  }
  return runs;
}

bool AllExited0(const std::vector<Run>& runs) {
  bool ok = true;
  for (const Run& r : runs) {
    bool good = WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0;
    if (!good) MESSAGE("worker failed: " << r.out);
    ok = ok && good;
  }
  return ok;
}

TEST_CASE("four processes commit one checkpoint; it restores bit-exact on four and on two processes") {
  testing::TempDir dir;
  auto saved = RunWorkers("save", dir.path(), 4, {"10", "3"});  // steps 10, 11, 12; keep 2
  REQUIRE(AllExited0(saved));
  auto m = CheckpointManager::OpenReadOnly(dir.path(), {});
  REQUIRE(m.ok());
  CHECK((*m)->AllSteps() == std::vector<int64_t>{11, 12});  // process 0 pruned step 10
  // Deleted, not recycled: in a multi-host job no process would reuse the
  // other processes' shard files.
  CHECK_FALSE(fs::exists(dir / ".recycle"));
  auto info = (*m)->Info(12);
  REQUIRE(info.ok());
  CHECK(info->tensors == 12);  // 4 processes x 3 tensors, one manifest
  CHECK((*m)->Verify(12).ok());
  CHECK(fs::exists(dir / "checkpoint_12/shard-p00003-00000.safetensors"));
  CHECK(AllExited0(RunWorkers("restore", dir.path(), 4, {"12", "4"})));
  CHECK(AllExited0(RunWorkers("restore", dir.path(), 2, {"12", "4"})));
  CHECK(AllExited0(RunWorkers("restore", dir.path(), 1, {"11", "4"})));
}

TEST_CASE("eight processes commit with the storage-only fallback") {
  testing::TempDir dir;
  REQUIRE(AllExited0(RunWorkers("save", dir.path(), 8, {"1", "2"})));
  auto m = CheckpointManager::OpenReadOnly(dir.path(), {});
  REQUIRE(m.ok());
  CHECK((*m)->AllSteps() == std::vector<int64_t>{1, 2});
  CHECK((*m)->Info(2)->tensors == 24);
  CHECK((*m)->Verify(2).ok());
  CHECK(AllExited0(RunWorkers("restore", dir.path(), 3, {"2", "8"})));
}

TEST_CASE("a process that dies mid-save: no manifest, a clear error for the others, the previous step restores") {
  testing::TempDir dir;
  // Process 2 of 4 dies at step 6 (its second save); the others time out,
  // and say after how long. (Were the timeout not applied they would wait
  // for ever: the test's own time limit ends that.)
  // Every worker gets --die-at 6; only process 2 acts on it.
  std::vector<Run> runs = RunWorkers("save", dir.path(), 4, {"5", "2", "--die-at", "6", "--timeout-ms", "2000"});
  int died = 0, failed_clearly = 0;
  for (const Run& r : runs) {
    if (WIFSIGNALED(r.status)) {
      ++died;
      continue;
    }
    bool clear = r.out.find("error at step 6") != std::string::npos &&
                 (r.out.find("barrier \"written/6\"") != std::string::npos ||
                  r.out.find("was not committed by process 0") != std::string::npos) &&
                 r.out.find(" 2000 ms") != std::string::npos;
    if (!clear) MESSAGE("unclear failure: " << r.out);
    failed_clearly += clear && WIFEXITED(r.status) && WEXITSTATUS(r.status) == 2;
  }
  CHECK(died == 1);
  CHECK(failed_clearly == 3);
  CHECK_FALSE(fs::exists(dir / "checkpoint_6/manifest.json"));
  auto m = CheckpointManager::OpenReadOnly(dir.path(), {});
  REQUIRE(m.ok());
  CHECK((*m)->AllSteps() == std::vector<int64_t>{5});
  CHECK(AllExited0(RunWorkers("restore", dir.path(), 2, {"5", "4"})));
}

// ---- Chunks of one array from several processes ----------------------------

using testing::InProcessBarrier;

// The `count` processes of a multi-host save as managers of this process,
// opened at once (with a barrier, Open waits for every process). A null
// barrier: the storage-only fallback.
std::vector<std::unique_ptr<CheckpointManager>> OpenProcesses(const std::string& root, int count,
                                                              std::shared_ptr<Barrier> barrier) {
  std::vector<std::optional<Result<std::unique_ptr<CheckpointManager>>>> opened(count);
  std::vector<std::thread> threads;
  for (int p = 0; p < count; ++p) {
    Options o = testing::SmallOptions(uint64_t{4} << 20);
    o.multihost.process_index = p;
    o.multihost.process_count = count;
    o.multihost.timeout = std::chrono::milliseconds(20000);
    threads.emplace_back([&opened, &root, &barrier, o, p] {
      opened[p].emplace(CheckpointManager::Open(root, o, barrier));
    });
  }
  for (std::thread& t : threads) t.join();
  std::vector<std::unique_ptr<CheckpointManager>> managers;
  for (int p = 0; p < count; ++p) {
    Result<std::unique_ptr<CheckpointManager>>& m = *opened[p];
    REQUIRE_MESSAGE(m.ok(), "process " << p << ": " << m.status().ToString());
    managers.push_back(std::move(m).value());
  }
  return managers;
}

// Rows [first, first + rows) of array "w" (F32, global shape [64, 8]), its
// bytes a function of its canonical name; its TensorRef leaves the name to
// the planner.
struct RowsOfW {
  RowsOfW(uint64_t first, uint64_t rows, int64_t step)
      : first(first), tensor(testing::MakeTensor(ChunkName("w", {first, 0}), DType::kF32, {rows, 8}, step)) {}
  TensorRef ref() const { return {"", tensor.dtype, tensor.shape, tensor.bytes.data(), {"w", {64, 8}, {first, 0}}}; }
  uint64_t first;
  testing::OwnedTensor tensor;
};

// Process p saves chunks[p] at `step`, all at the same time; the final
// statuses, by process.
std::vector<Status> SaveChunks(std::vector<std::unique_ptr<CheckpointManager>>& managers, int64_t step,
                               const std::vector<RowsOfW>& chunks) {
  std::vector<SaveHandle> handles;
  for (size_t p = 0; p < managers.size(); ++p) {
    const TensorRef ref = chunks[p].ref();
    auto h = managers[p]->Save(step, std::span<const TensorRef>(&ref, 1));
    REQUIRE_MESSAGE(h.ok(), "process " << p << ": " << h.status().ToString());
    handles.push_back(*h);
  }
  std::vector<Status> out;
  for (const SaveHandle& h : handles) out.push_back(h.Wait());
  return out;
}

TEST_CASE("on_busy skip is refused in a multi-host job, naming the knob, and nothing is written") {
  // Each process would decide alone: one skipping a step the others save
  // would leave their save of it waiting at the barrier.
  testing::TempDir dir;
  Options o = testing::SmallOptions(uint64_t{4} << 20);
  o.multihost.process_index = 1;
  o.multihost.process_count = 2;
  o.on_busy = OnBusy::kSkip;
  auto m = CheckpointManager::Open(dir.path(), o, nullptr);
  REQUIRE_FALSE(m.ok());
  CHECK(m.status().code() == StatusCode::kInvalidArgument);
  CHECK(m.status().message().find("on_busy \"skip\"") != std::string::npos);
  CHECK(m.status().message().find("process_count 2") != std::string::npos);
  CHECK(fs::is_empty(dir.path()));
  CHECK_FALSE(CheckpointManager::Open(dir.path() + "/new", o, nullptr).ok());
  CHECK_FALSE(fs::exists(dir / "new"));  // refused before any I/O: no root made
  o.multihost.process_count = 1;  // one process: its own choice, accepted
  o.multihost.process_index = 0;
  CHECK(CheckpointManager::Open(dir.path(), o, nullptr).ok());
}

TEST_CASE("two processes each save half of an array as chunks; the checkpoint holds the whole array") {
  testing::TempDir dir;
  const std::vector<RowsOfW> halves = {{0, 32, 4}, {32, 32, 4}};
  {
    auto managers = OpenProcesses(dir.path(), 2, nullptr);
    const std::vector<Status> saved = SaveChunks(managers, 4, halves);
    for (const Status& s : saved) CHECK_MESSAGE(s.ok(), s.ToString());
  }
  auto m = CheckpointManager::OpenReadOnly(dir.path(), {});
  REQUIRE(m.ok());
  CHECK((*m)->AllSteps() == std::vector<int64_t>{4});
  auto info = (*m)->Info(4);
  REQUIRE_MESSAGE(info.ok(), info.status().ToString());
  REQUIRE(info->tensor_list.size() == 2);
  for (size_t p = 0; p < 2; ++p) {
    CAPTURE(p);
    const TensorInfo& t = info->tensor_list[p];
    CHECK(t.name == halves[p].tensor.name);
    CHECK(t.shape == std::vector<uint64_t>{32, 8});
    CHECK(t.chunk.array == "w");
    CHECK(t.chunk.global_shape == std::vector<uint64_t>{64, 8});
    CHECK(t.chunk.start == std::vector<uint64_t>{32 * p, 0});
  }
  CHECK(info->tensor_list[1].name == "w@32,0");
  auto restored = (*m)->Restore(4);
  REQUIRE_MESSAGE(restored.ok(), restored.status().ToString());
  REQUIRE(restored->tensors.size() == 2);
  for (size_t p = 0; p < 2; ++p) {
    CHECK(restored->tensors[p].name == halves[p].tensor.name);
    CHECK(restored->tensors[p].bytes == halves[p].tensor.bytes);
  }
  CHECK((*m)->Verify(4).ok());
}

TEST_CASE("a process whose chunks leave a gap in the merged array fails the commit naming the array") {
  testing::TempDir dir;
  // Process 1 saves rows 32-48 of 32-64: each fragment is fine alone.
  const std::vector<RowsOfW> chunks = {{0, 32, 4}, {32, 16, 4}};
  {
    auto managers = OpenProcesses(dir.path(), 2, InProcessBarrier(2));
    const std::vector<Status> saved = SaveChunks(managers, 4, chunks);
    CHECK(saved[0].code() == StatusCode::kCorruption);
    CHECK(saved[0].message() == "cannot save step 4 to " + dir.path() +
                                    ": checkpoint_4/manifest.json (merged from 2 fragments): the chunks of array "
                                    "\"w\" cover 384 of the 512 elements of its global shape [64, 8]: a chunk is "
                                    "missing");
    CHECK(saved[1].code() == StatusCode::kUnavailable);
    CHECK(saved[1].message() == "cannot save step 4 to " + dir.path() +
                                    ": step 4 was not committed by process 0 (its log says why)");
  }
  CHECK_FALSE(fs::exists(dir / "checkpoint_4/manifest.json"));
  auto m = CheckpointManager::OpenReadOnly(dir.path(), {});
  REQUIRE(m.ok());
  CHECK((*m)->AllSteps().empty());
}

}  // namespace
}  // namespace ckptio
