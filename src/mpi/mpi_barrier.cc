#include "ckptio/mpi_barrier.h"

#include <thread>

namespace ckptio {
namespace {

class Mpi final : public Barrier {
 public:
  explicit Mpi(MPI_Comm comm) : comm_(comm) {}
  Status Wait(const std::string& name, std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    MPI_Request request;
    if (MPI_Ibarrier(comm_, &request) != MPI_SUCCESS) return InternalError("barrier \"" + name + "\": MPI_Ibarrier failed");
    for (;;) {
      int done = 0;
      if (MPI_Test(&request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        return InternalError("barrier \"" + name + "\": MPI_Test failed");
      }
      if (done) return Status::Ok();
      if (std::chrono::steady_clock::now() >= deadline) {
        int size = 0;
        MPI_Comm_size(comm_, &size);
        return DeadlineExceededError("barrier \"" + name + "\": not all " + std::to_string(size) +
                                     " MPI processes arrived within " + std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

 private:
  MPI_Comm comm_;
};

}  // namespace

std::shared_ptr<Barrier> MpiBarrier(MPI_Comm comm) { return std::make_shared<Mpi>(comm); }

}  // namespace ckptio
