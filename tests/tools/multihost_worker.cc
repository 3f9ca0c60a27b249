// multihost_worker: one process of a multi-host save or restore, for the
// multi-host tests.
//
//   multihost_worker save ROOT INDEX COUNT FIRST_STEP STEPS [--die-at STEP] [--timeout-ms T] [--tiers REMOTE]
//   multihost_worker restore ROOT INDEX COUNT STEP SAVED_COUNT [--tiers REMOTE]
//
// With --tiers, each process's root is ROOT/host<INDEX> (a host's own local
// tier), REMOTE the shared remote tier, saves are incremental (only w0
// changes after the first step), and every process also keeps a local copy
// of the next process's w1. A restore then reads its own tensors and that
// copy, and prints the bytes it read from the remote tier.
//
// Process INDEX of COUNT owns tensors "p<INDEX>/w<k>" whose bytes are a
// function of (step, INDEX, k). `save` saves steps FIRST_STEP.. one after
// the other; with --die-at, process 2 SIGKILLs itself instead of saving that
// step.
// `restore` restores step STEP of a checkpoint written by SAVED_COUNT
// processes: this process reads (by name) the tensors of every saved process
// p with p % COUNT == INDEX, and checks them bit-exact. With MPI (built as
// multihost_worker_mpi, run under mpirun) INDEX and COUNT come from MPI and
// are given as -1. Prints one line per step; exits non-zero on a failure.

#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "test_state.h"
#ifdef CKPTIO_WITH_MPI
#include "ckptio/mpi_barrier.h"
#endif

namespace {

using ckptio::testing::OwnedTensor;

bool tiers = false;

std::vector<OwnedTensor> Part(int64_t step, int process) {
  std::vector<OwnedTensor> out;
  for (int k = 0; k < 3; ++k) {
    std::string name = "p" + std::to_string(process) + "/w" + std::to_string(k);
    const int64_t version = tiers && k > 0 ? 1 : step;  // with tiers, w1 and w2 are frozen
    out.push_back(ckptio::testing::MakeTensor(name, ckptio::DType::kF32, {uint64_t(50'000 + 1000 * k)},
                                              version * 7919 + process));
  }
  return out;
}

// With tiers: the next process's w1, kept here as a local copy.
std::vector<OwnedTensor> Copies(int64_t step, int process, int count) {
  if (!tiers || count < 2) return {};
  std::vector<OwnedTensor> next = Part(step, (process + 1) % count);
  return {std::move(next[1])};
}

int Save(ckptio::CheckpointManager& m, int index, int count, int64_t first, int64_t steps, int64_t die_at) {
  for (int64_t step = first; step < first + steps; ++step) {
    if (step == die_at && index == 2) {  // --die-at concerns process 2 only
      std::printf("process %d dying at step %lld\n", index, static_cast<long long>(step));
      std::fflush(stdout);
      raise(SIGKILL);
    }
    auto part = Part(step, index);
    auto refs = ckptio::testing::Refs(part);
    auto copies = Copies(step, index, count);
    for (const OwnedTensor& c : copies) {
      refs.push_back(c.ref());
      refs.back().local_copy = true;
    }
    auto h = m.Save(step, refs, R"({"from": "multihost_worker"})");
    ckptio::Status s = h.ok() ? h->Wait() : h.status();
    if (!s.ok()) {
      std::printf("process %d error at step %lld: %s\n", index, static_cast<long long>(step), s.ToString().c_str());
      return 2;
    }
    std::printf("process %d saved step %lld\n", index, static_cast<long long>(step));
  }
  ckptio::Status s = tiers ? m.WaitUntilFinished(ckptio::CheckpointManager::Tier::kRemote) : m.WaitUntilFinished();
  if (!s.ok()) std::printf("process %d error: %s\n", index, s.ToString().c_str());
  return s.ok() ? 0 : 2;
}

int Restore(ckptio::CheckpointManager& m, int index, int count, int64_t step, int saved_count) {
  std::vector<OwnedTensor> want;
  for (int p = index; p < saved_count; p += count) {
    for (auto& t : Part(step, p)) want.push_back(std::move(t));
    for (auto& t : Copies(step, p, saved_count)) want.push_back(std::move(t));
  }
  std::vector<ckptio::Bytes> got(want.size());
  std::vector<ckptio::MutableTensorRef> into;
  for (size_t i = 0; i < want.size(); ++i) {
    got[i].resize(want[i].bytes.size());
    into.push_back({want[i].name, want[i].dtype, want[i].shape, got[i].data()});
  }
  auto r = m.RestoreInto(step, into);
  if (!r.ok()) {
    std::printf("process %d restore failed: %s\n", index, r.status().ToString().c_str());
    return 2;
  }
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i].bytes) {
      std::printf("process %d: tensor %s differs\n", index, want[i].name.c_str());
      return 2;
    }
  }
  std::printf("process %d restored %zu tensors of step %lld bit-exact (%llu bytes from the remote tier)\n", index,
              want.size(), static_cast<long long>(step),
              static_cast<unsigned long long>(m.stats().bytes_read_remote));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: see the file comment\n");
    return 1;
  }
  const std::string mode = argv[1], root = argv[2];
  int index = std::atoi(argv[3]), count = std::atoi(argv[4]);
  std::shared_ptr<ckptio::Barrier> barrier;
#ifdef CKPTIO_WITH_MPI
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  MPI_Comm_rank(MPI_COMM_WORLD, &index);
  MPI_Comm_size(MPI_COMM_WORLD, &count);
  barrier = ckptio::MpiBarrier(MPI_COMM_WORLD);
#endif
  int64_t die_at = -1, timeout_ms = 30000;
  std::string remote;
  for (int i = 7; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--die-at") == 0) die_at = std::atoll(argv[i + 1]);
    if (std::strcmp(argv[i], "--timeout-ms") == 0) timeout_ms = std::atoll(argv[i + 1]);
    if (std::strcmp(argv[i], "--tiers") == 0) remote = argv[i + 1];
  }
  tiers = !remote.empty();
  ckptio::Options o;
  o.staging_memory = 16 << 20;
  o.shard_size = 256 << 10;
  o.keep = 2;
  o.threads = 1;
  o.gcs.chunk_size = 256 << 10;
  o.multihost.process_index = index;
  o.multihost.process_count = count;
  o.multihost.timeout = std::chrono::milliseconds(timeout_ms);
  std::string at = root;
  if (tiers) {
    at = root + "/host" + std::to_string(index);
    o.tiers.remote = remote;
    o.incremental = true;
    o.keep = 3;
  }
  int rc = 0;
  {
    // Restoring needs no coordination: any number of readers, by name. With
    // tiers, a restart opens as the trainer would (a replaced host's empty
    // local tier included).
    auto m = mode == "save" || tiers ? ckptio::CheckpointManager::Open(at, o, barrier)
                                     : ckptio::CheckpointManager::OpenReadOnly(at, o);
    if (!m.ok()) {
      std::printf("process %d cannot open: %s\n", index, m.status().ToString().c_str());
      rc = 2;
    } else if (mode == "save") {
      rc = Save(**m, index, count, std::atoll(argv[5]), std::atoll(argv[6]), die_at);
    } else {
      rc = Restore(**m, index, count, std::atoll(argv[5]), std::atoi(argv[6]));
    }
  }
  std::fflush(stdout);
#ifdef CKPTIO_WITH_MPI
  MPI_Finalize();
#endif
  return rc;
}
