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
    return Complete(&request, "barrier \"" + name + "\"", "MPI_Ibarrier", deadline, timeout);
  }

  // Two non-blocking collectives: every process's size (MPI_Iallgather),
  // then the bytes (MPI_Iallgatherv), each polled as Wait() polls.
  Result<std::vector<std::string>> AllGather(const std::string& name, std::string bytes,
                                             std::chrono::milliseconds timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    const std::string what = "all-gather \"" + name + "\"";
    int size = 0;
    MPI_Comm_size(comm_, &size);
    if (bytes.size() > static_cast<size_t>(INT32_MAX)) {
      return InvalidArgumentError(what + ": " + std::to_string(bytes.size()) + " bytes, more than MPI can count");
    }
    int mine = static_cast<int>(bytes.size());
    std::vector<int> sizes(static_cast<size_t>(size));
    MPI_Request request;
    if (MPI_Iallgather(&mine, 1, MPI_INT, sizes.data(), 1, MPI_INT, comm_, &request) != MPI_SUCCESS) {
      return InternalError(what + ": MPI_Iallgather failed");
    }
    if (Status s = Complete(&request, what, "MPI_Iallgather", deadline, timeout); !s.ok()) return s;
    std::vector<int> displacements(sizes.size());
    int64_t total = 0;
    for (size_t p = 0; p < sizes.size(); ++p) {
      displacements[p] = static_cast<int>(total);
      total += sizes[p];
    }
    if (total > INT32_MAX) return InvalidArgumentError(what + ": " + std::to_string(total) + " bytes in all, more than MPI can count");
    std::string all(static_cast<size_t>(total), '\0');
    if (MPI_Iallgatherv(bytes.data(), mine, MPI_CHAR, all.data(), sizes.data(), displacements.data(), MPI_CHAR, comm_,
                        &request) != MPI_SUCCESS) {
      return InternalError(what + ": MPI_Iallgatherv failed");
    }
    if (Status s = Complete(&request, what, "MPI_Iallgatherv", deadline, timeout); !s.ok()) return s;
    std::vector<std::string> out;
    for (size_t p = 0; p < sizes.size(); ++p) out.push_back(all.substr(static_cast<size_t>(displacements[p]), static_cast<size_t>(sizes[p])));
    return out;
  }

 private:
  Status Complete(MPI_Request* request, const std::string& what, const char* call,
                  std::chrono::steady_clock::time_point deadline, std::chrono::milliseconds timeout) {
    for (;;) {
      int done = 0;
      if (MPI_Test(request, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) {
        return InternalError(what + ": MPI_Test of " + call + " failed");
      }
      if (done) return Status::Ok();
      if (std::chrono::steady_clock::now() >= deadline) {
        int size = 0;
        MPI_Comm_size(comm_, &size);
        return DeadlineExceededError(what + ": not all " + std::to_string(size) + " MPI processes arrived within " +
                                     std::to_string(timeout.count()) + " ms");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  MPI_Comm comm_;
};

}  // namespace

std::shared_ptr<Barrier> MpiBarrier(MPI_Comm comm) { return std::make_shared<Mpi>(comm); }

}  // namespace ckptio
