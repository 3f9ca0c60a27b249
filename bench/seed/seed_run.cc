// The trainer loop of `ckptio bench seed`, the same for every mode: compute,
// (untimed) CRC32C of the state for the audit, save; then the final wait,
// the audit and the clean-up.

#include <cstdio>

#include "base/status_macros.h"
#include "cli/common.h"
#include "cli/demo_state.h"
#include "seed/seed_experiment.h"
#include "seed/seed_trace.h"
#include "cli/trainer_sim.h"

namespace ckptio::cli {
namespace {

double Since(Clock::time_point start, Clock::time_point t) { return std::chrono::duration<double>(t - start).count(); }

// The timed part: `saves` rounds of compute and save, then the final wait.
void TrainerLoop(const SeedConfig& config, SeedSaver& saver, DemoState* state, ExpectedCrcs* expected,
                 ModeResult* r) {
  const Clock::time_point start = Clock::now();
  r->state_memory = state->bytes() * static_cast<uint64_t>(state->sets());
  for (int i = 1; i <= config.saves && r->error.empty(); ++i) {
    // A borrowing save still reading the set this compute overwrites holds
    // the trainer here: that wait is part of what the saves cost it.
    const Clock::time_point b0 = Clock::now();
    Result<bool> waited = saver.ReleaseBuffers(state->next_tensors());
    const Clock::time_point b1 = Clock::now();
    if (!waited.ok()) {
      r->error = "before compute " + std::to_string(i) + ": " + waited.status().message();
      break;
    }
    if (*waited) {
      r->borrow_wait += Since(b0, b1);
      r->blocked += Since(b0, b1);
      ++r->borrow_waits;
      r->spans.push_back({kBorrowWaitTrack, "wait for a borrowed set", Since(start, b0), Since(start, b1), ""});
    }
    const Clock::time_point c0 = Clock::now();
    const ComputeTiming ct = TimedCompute(*state, config.compute);
    r->compute += ct.wall;
    r->compute_cpu += ct.cpu;
    r->spans.push_back({kComputeTrack, "compute", Since(start, c0), Since(start, Clock::now()), ""});
    const int64_t step = SeedStep(i);
    if (config.audit) {
      const Clock::time_point a0 = Clock::now();
      (*expected)[step] = TensorCrcs(state->tensors());
      const Clock::time_point a1 = Clock::now();
      r->audit_paused += Since(a0, a1);
      r->spans.push_back({kComputeTrack, kAuditSpanName, Since(start, a0), Since(start, a1), ""});
    }
    const Clock::time_point s0 = Clock::now();
    Status s = saver.Save(step, state->tensors());
    const Clock::time_point s1 = Clock::now();
    if (!s.ok()) r->error = "save of step " + std::to_string(step) + ": " + s.message();
    r->blocked += Since(s0, s1);
    r->save_seconds.push_back(Since(s0, s1));
    r->spans.push_back({kSaveCallTrack, "Save(" + std::to_string(step) + ")", Since(start, s0), Since(start, s1), ""});
  }
  const Clock::time_point w0 = Clock::now();
  Status f = saver.Finish();
  const Clock::time_point w1 = Clock::now();
  if (!f.ok() && r->error.empty()) r->error = f.message();
  r->final_wait = Since(w0, w1);
  r->wall = Since(start, w1);
  r->total = r->wall - r->audit_paused;
  saver.Collect(start, r);
}

}  // namespace

Result<ModeResult> RunSeedMode(const SeedConfig& config, SeedMode mode, DemoState* state,
                               const std::string& trace_path) {
  ModeResult r;
  r.mode = mode;
  if (mode == SeedMode::kCkptioBorrow && state->sets() < 2) {
    return InvalidArgumentError("bench seed: the ckptio-borrow run needs a double-buffered state (2 sets)");
  }
  std::unique_ptr<SeedSaver> saver;
  if (mode == SeedMode::kNaive) {
    ASSIGN_OR_RETURN(saver, MakeNaiveSaver(config, state->tensors()));
  } else {
    ASSIGN_OR_RETURN(saver, MakeManagerSaver(config, mode, state->tensors(), trace_path));
  }
  ExpectedCrcs expected;
  TrainerLoop(config, *saver, state, &expected, &r);
  saver.reset();  // a manager writes its trace as it closes
  std::printf("  %s: %.1f s; auditing ...\n", SeedModeName(mode), r.total);
  std::fflush(stdout);
  r.audit = mode == SeedMode::kNaive ? AuditNaiveRoot(config, state->tensors(), expected)
                                     : AuditManagerRoot(config, mode, state->tensors(), expected);
  SummarizeAudit(&r.audit);
  if (config.cleanup) {
    Status s = mode == SeedMode::kNaive ? CleanupNaiveRoot(config) : CleanupManagerRoot(config, mode);
    if (!s.ok()) std::fprintf(stderr, "ckptio: cannot clean up %s: %s\n", config.ModeRoot(mode).c_str(), s.message().c_str());
  }
  return r;
}

}  // namespace ckptio::cli
