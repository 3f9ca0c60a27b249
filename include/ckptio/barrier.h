#pragma once
// Barrier: how the processes of a multi-host job wait for each other.
//
// Every process of a checkpoint calls Wait() with the same names, in the same
// order; a call returns once all process_count processes have made it, or
// fails when the timeout passes (the save then fails, nothing is committed).
// ckptio calls Wait() on a thread of its own, never on the trainer's thread
// or its I/O loop, so a barrier may block.
//
// Provided: CallbackBarrier (wrap jax.experimental.multihost_utils.
// sync_global_devices, torch.distributed.barrier, your own RPC...), MPI
// (include/ckptio/mpi_barrier.h, when built with Open MPI), and the
// storage-only fallback (options.multihost.barrier = "storage": no Barrier
// object; processes poll the checkpoint location).

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "ckptio/export.h"
#include "ckptio/status.h"

namespace ckptio {

class CKPTIO_EXPORT Barrier {
 public:
  virtual ~Barrier() = default;
  virtual Status Wait(const std::string& name, std::chrono::milliseconds timeout) = 0;
};

// A barrier that calls `fn(name, timeout)`.
CKPTIO_EXPORT std::shared_ptr<Barrier> CallbackBarrier(
    std::function<Status(const std::string& name, std::chrono::milliseconds timeout)> fn);

}  // namespace ckptio
