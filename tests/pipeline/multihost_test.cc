// Multi-host saves with the storage-only barrier: N processes
// (tests/tools/multihost_worker) each save their part; process 0 commits one
// checkpoint; it restores by name on another process count. One process dying
// mid-save: no manifest appears, the others fail clearly within the timeout,
// the previous checkpoint still restores.

#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
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

}  // namespace
}  // namespace ckptio
