#pragma once
// Barrier: how the processes of a multi-host job wait for each other.
//
// Every process of a checkpoint calls Wait() with the same names, in the same
// order; a call returns once all process_count processes have made it, or
// fails when the timeout passes (the save then fails, nothing is committed).
// ckptio calls Wait() on a thread of its own, never on the trainer's thread
// or its I/O loop, so a barrier may block.
//
// AllGather() also exchanges bytes: two tiers in a multi-host job give every
// host's local tier the whole manifest, so the processes swap their parts of
// it (and, when the manager opens, which steps each local tier holds). A
// barrier that cannot exchange leaves it unimplemented; ckptio then swaps
// them through the remote tier's storage instead.
//
// Provided: CallbackBarrier (wrap jax.experimental.multihost_utils.
// sync_global_devices, torch.distributed.barrier, your own RPC...; with an
// all-gather function too: jax's key-value store, torch's all_gather_object),
// MPI (include/ckptio/mpi_barrier.h, when built with Open MPI: both), and the
// storage-only fallback (options.multihost.barrier = "storage": no Barrier
// object; processes poll the checkpoint location).

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ckptio/export.h"
#include "ckptio/status.h"

namespace ckptio {

class CKPTIO_EXPORT Barrier {
 public:
  virtual ~Barrier() = default;
  virtual Status Wait(const std::string& name, std::chrono::milliseconds timeout) = 0;
  // Every process calls it with the same `name` (in the same order as
  // Wait()) and its own `bytes`; returns every process's bytes, by process
  // index, once all have called it. The default: Unimplemented.
  virtual Result<std::vector<std::string>> AllGather(const std::string& name, std::string bytes,
                                                     std::chrono::milliseconds timeout);
};

// The all-gather half of a CallbackBarrier: `fn(name, bytes, timeout)`
// returns every process's bytes, by process index.
using AllGatherFn =
    std::function<Result<std::vector<std::string>>(const std::string& name, std::string bytes,
                                                   std::chrono::milliseconds timeout)>;

// A barrier that calls `fn(name, timeout)`, and `all_gather` (if given) to
// exchange bytes.
CKPTIO_EXPORT std::shared_ptr<Barrier> CallbackBarrier(
    std::function<Status(const std::string& name, std::chrono::milliseconds timeout)> fn,
    AllGatherFn all_gather = nullptr);

}  // namespace ckptio
