// preempt_trainer ROOT: a trainer that saves the deterministic test state
// (tests/test_state.h) every few milliseconds with preemption.on_sigterm. Its
// final-save callback saves step (last step + 1000). Prints "ready" once a
// first checkpoint is committed; the preemption test then sends SIGTERM.

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "ckptio/checkpoint_manager.h"
#include "test_state.h"

int main(int argc, char** argv) {
  if (argc < 2) return 1;
  ckptio::Options o;
  o.staging_memory = 64 << 20;
  o.shard_size = 4 << 20;
  o.keep = 3;
  o.max_in_flight = 2;
  o.preemption.on_sigterm = true;
  o.preemption.grace = std::chrono::seconds(20);
  auto m = ckptio::CheckpointManager::Open(argv[1], o);
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
    return 2;
  }
  std::atomic<int64_t> last{0};
  (*m)->SetFinalSave([&last](ckptio::CheckpointManager& mgr) {
    int64_t step = last.load() + 1000;
    auto state = ckptio::testing::MakeState(step, 4, 500'000);
    auto refs = ckptio::testing::Refs(state);
    auto h = mgr.Save(step, refs);
    if (!h.ok()) std::fprintf(stderr, "final save: %s\n", h.status().ToString().c_str());
  });
  bool announced = false;
  for (int64_t step = 1;; ++step) {
    auto state = ckptio::testing::MakeState(step, 4, 500'000);
    auto refs = ckptio::testing::Refs(state);
    auto h = (*m)->Save(step, refs);
    if (!h.ok()) {  // refused once SIGTERM arrived: wait to be terminated
      std::this_thread::sleep_for(std::chrono::hours(1));
      return 3;
    }
    last = step;
    if (!announced && h->Wait().ok()) {
      std::printf("ready\n");
      std::fflush(stdout);
      announced = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}
