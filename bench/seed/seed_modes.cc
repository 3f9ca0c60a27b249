// The blocking, ckptio and ckptio-borrow modes of `ckptio bench seed` (each
// a CheckpointManager; they differ in whether the trainer waits for the
// commit, and in whether the snapshot copies or borrows the trainer's
// buffers), and the audit of what a manager left behind.

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "base/status_macros.h"
#include "cli/common.h"
#include "seed/seed_experiment.h"
#include "cli/trainer_sim.h"
#include "format/crc32c.h"
#include "base/dtype.h"

namespace ckptio::cli {
namespace {

class ManagerSaver final : public SeedSaver {
 public:
  ManagerSaver(std::unique_ptr<CheckpointManager> manager, SeedMode mode, std::string trace_path,
               uint64_t staging_memory)
      : manager_(std::move(manager)), mode_(mode), trace_path_(std::move(trace_path)),
        staging_memory_(staging_memory) {}

  Status Save(int64_t step, std::span<const TensorRef> tensors) override {
    const Clock::time_point s0 = Clock::now();
    const std::string metadata = std::string("{\"seed\":\"") + SeedModeName(mode_) + "\"}";
    ASSIGN_OR_RETURN(SaveHandle h, manager_->Save(step, tensors, metadata));
    if (mode_ == SeedMode::kBlocking && !h.skipped()) RETURN_IF_ERROR(h.Wait());
    saves_.push_back({s0, std::move(h), tensors.empty() ? nullptr : tensors.front().data});
    return Status::Ok();
  }

  // In borrow mode a save reads the trainer's buffers until it ends: wait
  // for every save that borrowed the set starting at `tensors`' first tensor.
  Result<bool> ReleaseBuffers(std::span<const TensorRef> tensors) override {
    if (mode_ != SeedMode::kCkptioBorrow || tensors.empty()) return false;
    bool waited = false;
    for (const Saved& s : saves_) {
      if (s.borrowed != tensors.front().data || s.handle.skipped() || s.handle.done()) continue;
      waited = true;
      Status st = s.handle.Wait();
      if (!st.ok()) return std::move(st).WithContext("waiting for the save that borrowed the buffers");
    }
    return waited;
  }

  Status Finish() override { return manager_->WaitUntilFinished(); }

  void Collect(Clock::time_point start, ModeResult* r) override {
    std::vector<std::pair<double, double>> intervals;
    r->staging_memory = staging_memory_;
    for (const auto& [begin, handle, borrowed] : saves_) {
      if (handle.skipped() || !handle.status().has_value() || !handle.status()->ok()) continue;
      const SaveTimings t = handle.timings();
      const double s = std::chrono::duration<double>(begin - start).count();
      intervals.emplace_back(s, s + t.snapshot_seconds + t.persist_seconds);
      r->bytes += t.bytes;
      r->spans.push_back({"saves in flight", "step " + std::to_string(handle.step()), s, intervals.back().second, ""});
    }
    r->max_in_flight = MaxOverlap(intervals);
    r->persisting = UnionLength(std::move(intervals));
    manager_.reset();  // writes the trace file
    r->trace_path = trace_path_;
  }

 private:
  static int MaxOverlap(const std::vector<std::pair<double, double>>& intervals) {
    std::vector<std::pair<double, int>> edges;
    for (const auto& [s, e] : intervals) {
      edges.emplace_back(s, 1);
      edges.emplace_back(e, -1);
    }
    std::sort(edges.begin(), edges.end());  // an end sorts before a start at the same time
    int cur = 0;
    int best = 0;
    for (const auto& [t, d] : edges) best = std::max(best, cur += d);
    return best;
  }

  struct Saved {
    Clock::time_point begin;
    SaveHandle handle;
    const void* borrowed;  // the first tensor's buffer: which set it read
  };

  std::unique_ptr<CheckpointManager> manager_;
  SeedMode mode_;
  std::string trace_path_;
  uint64_t staging_memory_;
  std::vector<Saved> saves_;
};

Options ManagerOptions(const SeedConfig& config, SeedMode mode, const std::string& trace_path) {
  Options o = config.options;
  o.keep = config.keep;
  if (mode == SeedMode::kCkptioBorrow) {
    // The trainer leaves the saved set alone until the save has ended
    // (ReleaseBuffers), so the save may read it in place.
    o.snapshot = SnapshotMode::kBorrow;
    o.staging_memory = config.borrow_staging_memory;
  } else {
    o.snapshot = SnapshotMode::kCopy;  // the trainer mutates its state right after Save()
  }
  o.trace.path = trace_path;
  return o;
}

// Compares one restored checkpoint with the state as of its save.
void CheckRestored(const RestoredCheckpoint& ckpt, std::span<const TensorRef> tensors,
                   const std::vector<uint32_t>* expected, StepAudit* a) {
  a->tensors_present = static_cast<int>(ckpt.tensors.size());
  a->complete = ckpt.tensors.size() == tensors.size();
  for (size_t i = 0; a->complete && i < tensors.size(); ++i) {
    const Tensor& t = ckpt.tensors[i];
    a->complete = t.name == tensors[i].name &&
                  t.bytes.size() == base::TensorBytes(tensors[i].dtype, tensors[i].shape).value();
  }
  if (!a->complete || expected == nullptr) return;
  a->checked = true;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = ckpt.tensors[i];
    if (format::Crc32c(t.bytes.data(), t.bytes.size()) != (*expected)[i]) ++a->tensors_torn;
  }
}

}  // namespace

const char* SeedModeName(SeedMode mode) {
  switch (mode) {
    case SeedMode::kBlocking: return "blocking";
    case SeedMode::kNaive: return "naive";
    case SeedMode::kCkptio: return "ckptio";
    case SeedMode::kCkptioBorrow: return "ckptio-borrow";
  }
  return "?";
}

bool IsCkptioMode(SeedMode mode) { return mode == SeedMode::kCkptio || mode == SeedMode::kCkptioBorrow; }

std::string SeedConfig::ModeRoot(SeedMode mode) const {
  std::string root = dest;
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  return root + "/" + SeedModeName(mode);
}

int64_t SeedStep(int i) { return int64_t{100} * i; }

bool ExpectedKept(const SeedConfig& config, int64_t step) {
  return config.keep <= 0 || step > SeedStep(config.saves - config.keep);
}

Result<std::unique_ptr<SeedSaver>> MakeManagerSaver(const SeedConfig& config, SeedMode mode,
                                                    std::span<const TensorRef> tensors, const std::string& trace_path) {
  const std::string root = config.ModeRoot(mode);
  const Options options = ManagerOptions(config, mode, trace_path);
  ASSIGN_OR_RETURN(auto manager, CheckpointManager::Open(root, options));
  ASSIGN_OR_RETURN(size_t cleared, ClearCheckpoints(*manager));
  if (cleared > 0) std::printf("  (removed %zu checkpoints of an earlier run from %s)\n", cleared, root.c_str());
  RETURN_IF_ERROR(WarmUp(*manager, tensors));
  return std::unique_ptr<SeedSaver>(new ManagerSaver(std::move(manager), mode, trace_path, options.staging_memory));
}

// Reads back every checkpoint the run left (through a read-only manager, so
// every length and CRC32C of the format is checked too) and compares each
// tensor with the state as of its save.
AuditResult AuditManagerRoot(const SeedConfig& config, SeedMode mode, std::span<const TensorRef> tensors,
                             const ExpectedCrcs& expected) {
  AuditResult audit;
  audit.tensors = static_cast<int>(tensors.size());
  auto manager = CheckpointManager::OpenReadOnly(config.ModeRoot(mode), ReadOnlyOptions(config.options));
  if (!manager.ok()) {
    audit.error = manager.status().message();
    return audit;
  }
  const std::vector<int64_t> steps = (*manager)->AllSteps();
  for (int i = 1; i <= config.saves; ++i) {
    StepAudit a;
    a.step = SeedStep(i);
    a.expected = ExpectedKept(config, a.step);
    a.present = std::find(steps.begin(), steps.end(), a.step) != steps.end();
    if (a.present && a.expected) {
      auto ckpt = (*manager)->Restore(a.step);
      auto it = expected.find(a.step);
      if (ckpt.ok()) CheckRestored(*ckpt, tensors, it == expected.end() ? nullptr : &it->second, &a);
    }
    audit.steps.push_back(a);
  }
  return audit;
}

void SummarizeAudit(AuditResult* audit) {
  for (const StepAudit& a : audit->steps) {
    if (!a.expected) {
      if (a.present) ++audit->leaked;
      continue;
    }
    ++audit->expected;
    if (!a.present) {
      ++audit->missing;
    } else if (!a.complete) {
      ++audit->incomplete;
    } else if (a.tensors_torn > 0) {
      ++audit->torn;
    } else {
      ++audit->good;
    }
  }
}

Status CleanupManagerRoot(const SeedConfig& config, SeedMode mode) {
  const std::string root = config.ModeRoot(mode);
  {
    ASSIGN_OR_RETURN(auto manager, CheckpointManager::Open(root, ReadOnlyOptions(config.options)));
    RETURN_IF_ERROR(ClearCheckpoints(*manager).status());
  }
  if (!config.gcs()) {
    // What the manager leaves in an empty root: its lock file.
    ::unlink((root + "/.ckptio.lock").c_str());
    ::rmdir(root.c_str());
  }
  return Status::Ok();
}

}  // namespace ckptio::cli
