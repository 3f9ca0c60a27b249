// Preemption: a real SIGTERM to a saving trainer (tests/tools/preempt_trainer)
// ends with its in-flight saves and a final save committed, a report on
// stderr, and the process terminated by SIGTERM as it would have been.

#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <regex>
#include <string>
#include <thread>

#include "ckptio/checkpoint_manager.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

struct Child {
  pid_t pid = -1;
  FILE* out = nullptr;
  int err_fd = -1;
};

Child Start(const std::string& exe, const std::string& root) {
  int out[2], err[2];
  REQUIRE(pipe(out) == 0);
  REQUIRE(pipe(err) == 0);
  Child c;
  c.pid = fork();
  if (c.pid == 0) {
    dup2(out[1], STDOUT_FILENO);
    dup2(err[1], STDERR_FILENO);
    execl(exe.c_str(), exe.c_str(), root.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  close(out[1]);
  close(err[1]);
  c.out = fdopen(out[0], "r");
  c.err_fd = err[0];
  return c;
}

std::string ReadAll(int fd) {
  std::string s;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof buf)) > 0) s.append(buf, static_cast<size_t>(n));
  return s;
}

TEST_CASE("SIGTERM lets in-flight saves and a final save commit, reports them, then terminates") {
  const char* exe = std::getenv("CKPTIO_PREEMPT_TRAINER");
  REQUIRE_MESSAGE(exe != nullptr, "CKPTIO_PREEMPT_TRAINER must name the preempt_trainer binary");
  testing::TempDir dir;
  Child c = Start(exe, dir.path());
  char line[64] = {};
  REQUIRE_MESSAGE(std::fgets(line, sizeof line, c.out) != nullptr, "the trainer never committed a checkpoint");
  CHECK(std::string(line) == "ready\n");
  std::this_thread::sleep_for(std::chrono::milliseconds(std::random_device{}() % 300));
  REQUIRE(kill(c.pid, SIGTERM) == 0);
  std::string err = ReadAll(c.err_fd);
  int status = 0;
  REQUIRE(waitpid(c.pid, &status, 0) == c.pid);
  std::fclose(c.out);
  close(c.err_fd);
  MESSAGE("trainer stderr: " << err);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGTERM);
  std::smatch m;
  REQUIRE(std::regex_search(err, m, std::regex("latest committed step: (\\d+); abandoned \\(not committed\\): none")));
  const int64_t latest = std::stoll(m[1]);
  CHECK(latest > 1000);  // the final save: last step + 1000

  auto mgr = CheckpointManager::OpenReadOnly(dir.path(), {});
  REQUIRE_MESSAGE(mgr.ok(), mgr.status().ToString());
  CHECK((*mgr)->LatestStep() == latest);
  auto r = (*mgr)->Restore(latest);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  auto want = testing::MakeState(latest, 4, 500'000);
  bool same = r->tensors.size() == want.size();
  for (size_t i = 0; same && i < want.size(); ++i) same = r->tensors[i].bytes == want[i].bytes;
  CHECK(same);
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) {
    CHECK_MESSAGE(e.path().filename().string().find(".tmp-") == std::string::npos, "debris: " << e.path());
  }
}

TEST_CASE("a manager refuses a second SIGTERM handler in the same process") {
  testing::TempDir a, b;
  Options o;
  o.staging_memory = 1 << 20;
  o.preemption.on_sigterm = true;
  auto first = CheckpointManager::Open(a.path(), o);
  REQUIRE(first.ok());
  auto second = CheckpointManager::Open(b.path(), o);
  CHECK(second.status().code() == StatusCode::kFailedPrecondition);
  CHECK(second.status().message().find("another CheckpointManager already handles SIGTERM") != std::string::npos);
}

}  // namespace
}  // namespace ckptio
