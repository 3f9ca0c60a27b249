// Crash safety: a process saving in a loop is SIGKILLed at random moments;
// after each kill, recovery must leave no debris and the latest checkpoint
// must restore bit-exact: the previous or the new one, never a torn one.

#include <doctest/doctest.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <thread>

#include "ckptio/checkpoint_manager.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;

struct Saver {
  pid_t pid = -1;
  int out = -1;  // the read end of its stdout
  std::string pending;  // read from it, not yet a whole line
};

Saver StartSaver(const std::string& exe, const std::string& root, const char* mode) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) return {};
  pid_t pid = fork();
  if (pid == 0) {
    dup2(p[1], STDOUT_FILENO);
    execl(exe.c_str(), exe.c_str(), root.c_str(), mode, static_cast<char*>(nullptr));
    _exit(127);
  }
  close(p[1]);
  return {pid, p[0], {}};
}

// Reads the saver's stdout until a line starts with `prefix`: true, or
// false at end of file (it exited) or after `limit` without one (a guard
// against a hang, not a measure).
bool WaitForLine(Saver& saver, const std::string& prefix, std::chrono::seconds limit) {
  std::string& pending = saver.pending;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    for (size_t nl; (nl = pending.find('\n')) != std::string::npos;) {
      const std::string line = pending.substr(0, nl);
      pending.erase(0, nl + 1);
      if (line.rfind(prefix, 0) == 0) return true;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    struct pollfd pfd = {saver.out, POLLIN, 0};
    if (poll(&pfd, 1, static_cast<int>(left.count())) <= 0) continue;
    char buf[256];
    const ssize_t n = read(saver.out, buf, sizeof buf);
    if (n <= 0) return false;
    pending.append(buf, static_cast<size_t>(n));
  }
}

// CKPTIO_KILLS sets the number of kills (make test: 24, 8 per mode; tests/soak/sigkill_soak.sh: 1,000).
// The kill comes at a random moment after an event of the saver's, not
// after a fixed time (the machine may be loaded: an ASan saver under load
// once took longer than every delay to commit its first step, and no round
// had anything to check): in even rounds after it reports a step committed
// in this run, in every other odd round after it reports the manager open
// (recovery done; the first save may or may not have committed), in the
// rest after it starts (perhaps mid-recovery).
// The saver's rounds cycle through three modes: whole saves; incremental
// saves, which refer to the shards of earlier steps (the rounds after, and
// recovery, prune with those references on disk); and two tiers, which copy
// each committed step to ROOT-remote (killed mid-copy too): the remote
// tier's committed steps must restore bit-exact and never go missing either.
TEST_CASE("a saver SIGKILLed at random moments always leaves the previous or the new checkpoint") {
  const char* exe = std::getenv("CKPTIO_CRASH_SAVER");
  REQUIRE_MESSAGE(exe != nullptr, "CKPTIO_CRASH_SAVER must name the crash_saver binary");
  const char* kills_env = std::getenv("CKPTIO_KILLS");
  const int kills = kills_env != nullptr ? std::atoi(kills_env) : 24;
  int torn = 0, lost = 0, restored = 0;
  testing::TempDir dir;
  const unsigned seed = std::random_device{}();
  MESSAGE("kill-time seed " << seed);
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> delay_ms(0, 400);
  int64_t last_latest = 0, last_remote = 0;
  const std::string remote_root = dir.path() + "-remote";  // the "tiers" rounds' remote tier
  struct RemoveRemote {
    std::string path;
    ~RemoveRemote() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  } remove_remote{remote_root};
  // Restores the newest step of `root` bit-exact and verifies every step:
  // the number of torn checkpoints found.
  auto check_root = [](CheckpointManager& m, int64_t latest) {
    int bad = 0;
    auto r = m.Restore(latest);
    REQUIRE_MESSAGE(r.ok(), m.root() << ": " << r.status().ToString());
    auto want = testing::CrashState(latest);
    REQUIRE(r->tensors.size() == want.size());
    for (size_t i = 0; i < want.size(); ++i) bad += r->tensors[i].bytes != want[i].bytes;
    for (int64_t step : m.AllSteps()) {
      auto v = m.Verify(step);
      bad += !v.ok();
      CHECK_MESSAGE(v.ok(), v.status().ToString());
    }
    return bad;
  };
  for (int round = 0; round < kills; ++round) {
    static const char* const kModes[] = {"whole", "incremental", "tiers"};
    Saver saver = StartSaver(exe, dir.path(), kModes[round % 3]);
    REQUIRE(saver.pid > 0);
    const char* event = round % 2 == 0 ? "committed" : round % 4 == 1 ? "opened" : nullptr;
    const bool seen = event == nullptr || WaitForLine(saver, event, std::chrono::seconds(300));
    if (seen) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));
    kill(saver.pid, SIGKILL);
    close(saver.out);
    int status = 0;
    REQUIRE(waitpid(saver.pid, &status, 0) == saver.pid);
    REQUIRE_MESSAGE(WIFSIGNALED(status), "crash_saver exited on its own with status " << status);
    REQUIRE_MESSAGE(seen, "round " << round << ": crash_saver wrote no \"" << event << "\" line in 300 s");

    Options o;
    o.staging_memory = 8 << 20;
    o.keep = 3;
    auto m = CheckpointManager::Open(dir.path(), o);  // takes the lock, recovers
    REQUIRE_MESSAGE(m.ok(), m.status().ToString());
    for (const auto& e : fs::directory_iterator(dir.path())) {
      CHECK_MESSAGE(e.path().filename().string().find(".tmp-") == std::string::npos,
                    "debris left after recovery: " << e.path());
    }
    if (fs::exists(remote_root)) {  // the remote tier recovers on its own too
      auto remote = CheckpointManager::Open(remote_root, o);
      REQUIRE_MESSAGE(remote.ok(), remote.status().ToString());
      for (const auto& e : fs::directory_iterator(remote_root)) {
        CHECK_MESSAGE(e.path().filename().string().find(".tmp-") == std::string::npos, "remote debris " << e.path());
      }
      if (std::optional<int64_t> newest = (*remote)->LatestStep()) {
        lost += *newest < last_remote;
        last_remote = std::max(last_remote, *newest);
        torn += check_root(**remote, *newest);
      }
    }
    std::optional<int64_t> latest = (*m)->LatestStep();
    if (!latest) continue;  // killed before the first commit
    lost += *latest < last_latest;  // a committed checkpoint went missing
    last_latest = std::max(last_latest, *latest);
    torn += check_root(**m, *latest);
    ++restored;
  }
  MESSAGE("SIGKILL soak: " << kills << " kills, " << restored << " restores checked, torn " << torn << ", lost "
                           << lost);
  std::printf("sigkill soak: kills %d, restores checked %d, torn %d, lost %d\n", kills, restored, torn, lost);
  CHECK(torn == 0);
  CHECK(lost == 0);
  CHECK(last_latest > 0);
  MESSAGE("remote tier: newest step " << last_remote);
}

}  // namespace
}  // namespace ckptio
