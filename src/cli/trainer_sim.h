#pragma once
// What the simulated trainers of `ckptio demo` and `ckptio bench seed` share:
// timed compute (wall and thread CPU time), the untimed warm-up saves, the
// per-tensor CRC32C of a state (to tell a torn checkpoint from a good one),
// and the union length of save intervals.
//
// Threads: the trainer's thread; nothing here keeps state.

#include <chrono>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "ckptio/status.h"
#include "ckptio/tensor.h"
#include "cli/demo_state.h"

namespace ckptio::cli {

// The trainer's view of one Compute(): wall time, and the CPU time its own
// thread got meanwhile. The demo's compute is time-boxed, so competition for
// the cores (background I/O, CRC32C, an emulator) does not make it longer:
// it shows as cpu < wall, i.e. less training done in the same time.
struct ComputeTiming {
  double wall = 0;
  double cpu = 0;
};
ComputeTiming TimedCompute(DemoState& state, std::chrono::nanoseconds duration);

// CPU time of the calling thread, in seconds.
double ThreadCpuSeconds();

// CRC32C of each tensor's bytes, in order.
std::vector<uint32_t> TensorCrcs(std::span<const TensorRef> tensors);

// Deletes every committed checkpoint of `manager` (an earlier run's).
// Returns how many there were.
Result<size_t> ClearCheckpoints(CheckpointManager& manager);

// Waits for staging memory to be resident, then makes two overlapping
// untimed saves (steps 0 and 1) and deletes them: they pay the first-touch
// costs (staging pages, the writer's start-up, an HTTP connection pool) that
// a real trainer pays long before its first save, since it opens the manager
// at start-up and trains for minutes before it saves.
Status WarmUp(CheckpointManager& manager, std::span<const TensorRef> tensors);

// The machine's limit for a snapshot: bytes/s of a plain memcpy of `bytes`
// between two warm buffers, split across `threads` threads (as the snapshot
// splits its copy across the cores), best of a few runs. Allocates 2 x bytes
// for the duration of the call.
double MeasureCopyBytesPerSecond(uint64_t bytes, unsigned threads);

// Length of the union of [start, end) intervals (overlapping saves would be
// counted twice by a plain sum).
double UnionLength(std::vector<std::pair<double, double>> intervals);

}  // namespace ckptio::cli
