// crash_saver ROOT [whole|incremental|tiers]: saves the deterministic test
// state (tests/test_state.h: CrashState) at steps 1, 2, 3, ... forever,
// keep=3, two saves in flight, until killed. "incremental": incremental
// saves; "tiers": two tiers, every step copied to ROOT-remote (keep 3).
// The crash tests SIGKILL it at random moments, measured from the lines it
// writes on stdout: "opened" once the manager is open (recovery done), and
// "committed N" each time a newer step N is committed.

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "ckptio/checkpoint_manager.h"
#include "test_state.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: crash_saver ROOT [whole|incremental|tiers]\n");
    return 1;
  }
  ckptio::Options o;
  o.staging_memory = 32 << 20;
  o.shard_size = 1 << 20;
  o.keep = 3;
  o.max_in_flight = 2;
  o.threads = 2;
  const std::string mode = argc > 2 ? argv[2] : "whole";
  o.incremental = mode == "incremental";
  if (mode == "tiers") o.tiers.remote = std::string(argv[1]) + "-remote";
  auto m = ckptio::CheckpointManager::Open(argv[1], o);
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
    return 2;
  }
  // Unbuffered: the test reads each line as it is written.
  auto say = [](const std::string& line) {
    const std::string l = line + "\n";
    (void)!::write(STDOUT_FILENO, l.data(), l.size());
  };
  say("opened");
  int64_t step = (*m)->LatestStep().value_or(0);
  int64_t reported = step;
  for (;;) {
    ++step;
    auto state = ckptio::testing::CrashState(step);
    auto refs = ckptio::testing::Refs(state);
    auto h = (*m)->Save(step, refs);
    if (!h.ok()) {
      std::fprintf(stderr, "%s\n", h.status().ToString().c_str());
      return 2;
    }
    if (int64_t latest = (*m)->LatestStep().value_or(0); latest > reported) {
      reported = latest;
      say("committed " + std::to_string(latest));
    }
  }
}
