#pragma once
// An MPI barrier for multi-host checkpoints (link ckptio_mpi).
//
// Wait() starts MPI_Ibarrier and polls MPI_Test every millisecond until it
// completes or the timeout passes, so it never blocks inside MPI; AllGather()
// does the same with MPI_Iallgather (the sizes) and MPI_Iallgatherv (the
// bytes). REQUIRES: MPI initialized with MPI_THREAD_MULTIPLE (ckptio calls MPI
// from a thread of its own). After a timeout the communicator has a barrier
// that never completed: the job should stop.

#include <mpi.h>

#include <memory>

#include "ckptio/barrier.h"

namespace ckptio {

std::shared_ptr<Barrier> MpiBarrier(MPI_Comm comm = MPI_COMM_WORLD);

}  // namespace ckptio
