#include "cli/trainer_sim.h"

#include <time.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <thread>

#include "base/status_macros.h"
#include "format/crc32c.h"
#include "base/dtype.h"

namespace ckptio::cli {

double ThreadCpuSeconds() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

ComputeTiming TimedCompute(DemoState& state, std::chrono::nanoseconds duration) {
  const auto start = std::chrono::steady_clock::now();
  const double cpu0 = ThreadCpuSeconds();
  state.Compute(duration);
  ComputeTiming t;
  t.cpu = ThreadCpuSeconds() - cpu0;
  t.wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return t;
}

std::vector<uint32_t> TensorCrcs(std::span<const TensorRef> tensors) {
  std::vector<uint32_t> out;
  out.reserve(tensors.size());
  for (const TensorRef& t : tensors) {
    const uint64_t n = base::TensorBytes(t.dtype, t.shape).value();
    out.push_back(format::Crc32c(t.data, n));
  }
  return out;
}

Result<size_t> ClearCheckpoints(CheckpointManager& manager) {
  const std::vector<int64_t> steps = manager.AllSteps();
  for (int64_t step : steps) RETURN_IF_ERROR(manager.Delete(step));
  return steps.size();
}

Status WarmUp(CheckpointManager& manager, std::span<const TensorRef> tensors) {
  manager.WaitUntilReady();
  std::vector<SaveHandle> saves;
  for (int64_t step : {0, 1}) {
    ASSIGN_OR_RETURN(SaveHandle h, manager.Save(step, tensors, "{\"warm_up\":true}"));
    saves.push_back(std::move(h));
  }
  for (const SaveHandle& h : saves) {
    if (!h.skipped()) RETURN_IF_ERROR(h.Wait());
  }
  RETURN_IF_ERROR(manager.WaitUntilFinished());
  // A small `keep` may have pruned some of them already.
  for (int64_t step : manager.AllSteps()) RETURN_IF_ERROR(manager.Delete(step));
  return Status::Ok();
}

double MeasureCopyBytesPerSecond(uint64_t bytes, unsigned threads) {
  threads = std::max(1u, threads);
  bytes = std::max<uint64_t>(bytes, threads);
  auto src = std::make_unique<char[]>(bytes);
  auto dst = std::make_unique<char[]>(bytes);
  // Both touched first: first-touch page faults are not the limit a reused,
  // pre-faulted staging pool runs into.
  std::memset(src.get(), 1, bytes);
  std::memset(dst.get(), 2, bytes);
  const uint64_t part = bytes / threads;
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < threads; ++t) {
      const uint64_t begin = t * part;
      const uint64_t len = t + 1 == threads ? bytes - begin : part;
      workers.emplace_back([&src, &dst, begin, len] { std::memcpy(dst.get() + begin, src.get() + begin, len); });
    }
    for (std::thread& w : workers) w.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, static_cast<double>(bytes) / std::max(s, 1e-9));
  }
  return best;
}

double UnionLength(std::vector<std::pair<double, double>> intervals) {
  std::sort(intervals.begin(), intervals.end());
  double total = 0;
  double cur_start = 0;
  double cur_end = -1;
  for (const auto& [s, e] : intervals) {
    if (s > cur_end) {
      if (cur_end > cur_start) total += cur_end - cur_start;
      cur_start = s;
      cur_end = e;
    } else {
      cur_end = std::max(cur_end, e);
    }
  }
  if (cur_end > cur_start) total += cur_end - cur_start;
  return total;
}

}  // namespace ckptio::cli
