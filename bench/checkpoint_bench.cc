// bench/checkpoint_bench: what a save costs the trainer, and how fast it
// persists, against the machine's limits measured in the same run.
//
//   checkpoint_bench [--dir DIR] [--sizes-gib 1,4] [--saves N] [--skip-fio]
//
// For each state size: the time Save() blocks the caller (copy mode) against
// a 2-thread memcpy of the same bytes into warm memory; the same in borrow
// mode; persist throughput (snapshot end -> durable commit) against fio's
// O_DIRECT sequential write of the same size; CPU-seconds per GiB; peak RSS
// against state + staging_memory + 64 MiB.

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.h"
#include "ckptio/checkpoint_manager.h"

namespace ckptio::bench {
namespace {

struct Args {
  std::string dir = "bench/results/tmp";
  std::vector<size_t> sizes_gib{1, 4};
  int saves = 3;
  bool fio = true;
};

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&] { return FlagValue("checkpoint_bench", argc, argv, &i); };
    if (s == "--dir") {
      a.dir = next();
    } else if (s == "--sizes-gib") {
      a.sizes_gib.clear();
      std::stringstream ss(next());
      for (std::string x; std::getline(ss, x, ',');) a.sizes_gib.push_back(std::stoul(x));
    } else if (s == "--saves") {
      a.saves = std::stoi(next());
    } else if (s == "--skip-fio") {
      a.fio = false;
    } else {
      std::fprintf(stderr, "usage: checkpoint_bench [--dir DIR] [--sizes-gib 1,4] [--saves N] [--skip-fio]\n");
      std::exit(s == "--help" ? 0 : 1);
    }
  }
  return a;
}

// ~100 tensors of mixed sizes making up `bytes`, in one warm allocation.
struct State {
  AlignedBuffer buf;
  std::vector<TensorRef> tensors;
};

State MakeState(size_t bytes) {
  State s{WarmBuffer(bytes, 11), {}};
  const size_t n = 100;
  size_t off = 0;
  for (size_t i = 0; i < n && off < bytes; ++i) {
    // Sizes vary 0.5x..1.5x of the mean, multiples of 4 KiB (F32 elements).
    size_t mean = bytes / n;
    size_t want = (i + 1 == n) ? bytes - off : std::min(bytes - off, (mean / 2 + (mean * (i % 11)) / 10) & ~size_t{4095});
    s.tensors.push_back({"layer" + std::to_string(i) + "/kernel", DType::kF32, {want / 4}, s.buf.get() + off});
    off += want;
  }
  return s;
}

// The same ~100 tensors with odd sizes (not whole 4 KiB blocks, as biases
// and norms of real models), each at 16 bytes past a page boundary as glibc
// places large allocations (numpy arrays): no tensor sits in memory where
// its file offset is block-aligned, so O_DIRECT writes go through bounce
// buffers.
State MakeOddState(size_t bytes) {
  const size_t n = 100;
  State s{WarmBuffer(bytes + (n + 1) * 8192, 13), {}};
  size_t off = 0, mem = 0;
  for (size_t i = 0; i < n && off < bytes; ++i) {
    size_t mean = bytes / n;
    size_t want = (i + 1 == n) ? bytes - off : std::min(bytes - off, (mean / 2 + (mean * (i % 11)) / 10) | 0x6A5);
    mem = (mem + 4095) / 4096 * 4096 + 16;
    s.tensors.push_back({"layer" + std::to_string(i) + "/kernel", DType::kU8, {want}, s.buf.get() + mem});
    off += want;
    mem += want;
  }
  return s;
}

// A 2-thread memcpy of `bytes` into warm memory, in a child process so its
// destination buffer does not count in this process's peak RSS.
double TwoThreadMemcpySeconds(const char* src, size_t bytes) {
  int fds[2];
  if (pipe(fds) != 0) return 0;
  pid_t pid = fork();
  if (pid == 0) {
    AlignedBuffer dst = WarmBuffer(bytes, 5);
    double best = 1e9;
    for (int r = 0; r < 3; ++r) {
      Phase p;
      std::thread t([&] { std::memcpy(dst.get() + bytes / 2, src + bytes / 2, bytes - bytes / 2); });
      std::memcpy(dst.get(), src, bytes / 2);
      t.join();
      best = std::min(best, p.wall());
    }
    if (write(fds[1], &best, sizeof best) != sizeof best) _exit(1);
    _exit(0);
  }
  close(fds[1]);
  double secs = 0;
  if (read(fds[0], &secs, sizeof secs) != sizeof secs) secs = 0;
  close(fds[0]);
  waitpid(pid, nullptr, 0);
  return secs;
}

struct SaveRun {
  double blocked = 0;
  double persist = 0;
  double cpu = 0;
  uint64_t bytes = 0;
};

template <typename T, typename Key>
T Median(std::vector<T> v, Key key) {
  std::sort(v.begin(), v.end(), [&](const T& a, const T& b) { return key(a) < key(b); });
  return v[v.size() / 2];
}

// Runs `saves` saves; after each, runs `between` (fio, so both share the
// disk's mood: this VM's disk speed drifts by 2x over minutes).
std::vector<SaveRun> RunSaves(const std::string& root, const State& state, size_t bytes, SnapshotMode mode, int saves,
                              const std::function<void()>& between, SnapshotCrc crc = SnapshotCrc::kBackground,
                              Options::Io::Direct direct = Options::Io::Direct::kAuto) {
  std::filesystem::remove_all(root);
  Options o;
  o.staging_memory = bytes + (64 << 20);
  o.snapshot = mode;
  o.snapshot_crc = crc;
  o.keep = 1;
  o.io.direct = direct;
  auto m = CheckpointManager::Open(root, o);
  if (!m.ok()) {
    std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
    std::exit(2);
  }
  // A warm-up save, not counted: staging pre-faults in the background after
  // Open (first touch of VM memory runs at ~0.5 GB/s here, even with huge
  // pages), which a trainer's minutes of work before its first save hide.
  {
    auto h = (*m)->Save(0, state.tensors);
    if (!h.ok() || !h->Wait().ok()) std::exit(2);
  }
  std::vector<SaveRun> runs;
  for (int i = 0; i < saves; ++i) {
    Phase p;
    auto h = (*m)->Save(i + 1, state.tensors);
    if (!h.ok()) {
      std::fprintf(stderr, "%s\n", h.status().ToString().c_str());
      std::exit(2);
    }
    Status s = h->Wait();
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      std::exit(2);
    }
    SaveTimings t = h->timings();
    runs.push_back({t.snapshot_seconds, t.persist_seconds, p.cpu(), t.bytes});
    if (between) between();
  }
  m->reset();
  std::filesystem::remove_all(root);
  return runs;
}

}  // namespace
}  // namespace ckptio::bench

int main(int argc, char** argv) {
  using namespace ckptio;
  using namespace ckptio::bench;
  Args args = ParseArgs(argc, argv);
  std::filesystem::create_directories(args.dir);
  std::printf("## Checkpoint benchmark\n\n%s; files in %s; median of %d saves per row\n\n", MachineLine().c_str(),
              args.dir.c_str(), args.saves);
  Table blocked({"state", "memcpy 2 threads", "Save() blocked, copy", "ratio", "copy with fused CRC32C", "ratio",
                 "Save() blocked, borrow"});
  Table persist({"state", "ckptio persist GB/s", "fio GB/s", "ratio", "fio rewrite GB/s", "ratio",
                 "ckptio CPU s/GiB", "peak RSS", "state + staging + 64 MiB"});
  Table borrowed({"state", "tensors", "written", "persist GB/s", "fio GB/s", "ratio", "CPU s/GiB"});
  for (size_t gib : args.sizes_gib) {
    const size_t bytes = gib << 30;
    State state = MakeState(bytes);
    double memcpy_s = TwoThreadMemcpySeconds(state.buf.get(), bytes);
    const std::string root = args.dir + "/ckpt";
    std::vector<Rate> fios, refios;
    auto run_fio = [&] {
      fios.push_back(FioWrite(args.dir + "/fio.bin", bytes, 4 << 20, 8));
      refios.push_back(FioWrite(args.dir + "/fio.bin", bytes, 4 << 20, 8, /*rewrite=*/true));
    };
    auto copies = RunSaves(root, state, bytes, SnapshotMode::kCopy, args.saves, args.fio ? std::function<void()>(run_fio) : std::function<void()>());
    long rss_kib = PeakRssKiB();
    auto borrows = RunSaves(root, state, bytes, SnapshotMode::kBorrow, args.saves, nullptr);
    auto fused = RunSaves(root, state, bytes, SnapshotMode::kCopy, args.saves, nullptr, SnapshotCrc::kFused);
    double fused_blocked = Median(fused, [](const SaveRun& r) { return r.blocked; }).blocked;
    SaveRun copy = Median(copies, [](const SaveRun& r) { return r.bytes / r.persist; });
    copy.blocked = Median(copies, [](const SaveRun& r) { return r.blocked; }).blocked;
    SaveRun borrow = Median(borrows, [](const SaveRun& r) { return r.blocked; });
    Rate fio = args.fio ? Median(fios, [](const Rate& r) { return r.gbps(); }) : Rate{};
    Rate refio = args.fio ? Median(refios, [](const Rate& r) { return r.gbps(); }) : Rate{};
    std::string label = std::to_string(gib) + " GiB, " + std::to_string(state.tensors.size()) + " tensors";
    blocked.Add({label, Fmt("%.1f ms", memcpy_s * 1e3), Fmt("%.1f ms", copy.blocked * 1e3),
                 Fmt("%.2fx", copy.blocked / memcpy_s), Fmt("%.1f ms", fused_blocked * 1e3),
                 Fmt("%.2fx", fused_blocked / memcpy_s), Fmt("%.2f ms", borrow.blocked * 1e3)});
    double gbps = copy.bytes / copy.persist / 1e9;
    double limit_mib = (bytes + (bytes + (64 << 20)) + (64 << 20)) / double(1 << 20);
    auto add_borrow = [&](const std::string& tensors, const std::string& how, const std::vector<SaveRun>& runs) {
      SaveRun r = Median(runs, [](const SaveRun& x) { return x.bytes / x.persist; });
      double g = r.bytes / r.persist / 1e9;
      borrowed.Add({label, tensors, how, Fmt("%.3f", g), args.fio ? Fmt("%.3f", fio.gbps()) : "-",
                    args.fio ? Fmt("%.2fx", g / fio.gbps()) : "-", Fmt("%.3f", r.cpu / (bytes / double(1 << 30)))});
    };
    add_borrow("whole 4 KiB blocks, page-aligned", "O_DIRECT from the tensors", borrows);
    {
      State odd = MakeOddState(bytes);
      add_borrow("odd sizes, 16 B past a page", "O_DIRECT via bounce buffers",
                 RunSaves(root, odd, bytes, SnapshotMode::kBorrow, args.saves, nullptr));
      add_borrow("odd sizes, 16 B past a page", "page cache (io.direct false)",
                 RunSaves(root, odd, bytes, SnapshotMode::kBorrow, args.saves, nullptr, SnapshotCrc::kBackground,
                          Options::Io::Direct::kOff));
    }
    persist.Add({label, Fmt("%.3f", gbps), args.fio ? Fmt("%.3f", fio.gbps()) : "-",
                 args.fio ? Fmt("%.2fx", gbps / fio.gbps()) : "-", args.fio ? Fmt("%.3f", refio.gbps()) : "-",
                 args.fio ? Fmt("%.2fx", gbps / refio.gbps()) : "-", Fmt("%.3f", copy.cpu / (bytes / double(1 << 30))),
                 Fmt("%.0f MiB", rss_kib / 1024.0), Fmt("%.0f MiB", limit_mib)});
  }
  std::printf("### What a save costs the trainer\n\n");
  blocked.Print();
  std::printf("\n### Persisting\n\n");
  persist.Print();
  std::printf("\n### Borrow mode (no copy): tensors that are not 4 KiB-aligned\n\n");
  borrowed.Print();
  std::printf("\nBorrowed tensors go out with O_DIRECT wherever their memory agrees with their file offset mod "
              "4 KiB; the rest is copied into io.queue_depth x io.block_size bounce buffers (32 MiB, reused) on the "
              "CPU pool. Before, one such tensor sent its whole shard through the page cache (last row).\n");
  std::printf("\npersist = snapshot end -> durable commit (shards fdatasync'd, manifest, renames, fsyncs), "
              "staging_memory = state + 64 MiB; fio: ioengine=io_uring direct=1 bs=4M iodepth=8 on the same "
              "file system, into a fresh file, and (rewrite) again over the file a first pass wrote, as ckptio "
              "writes into the files of pruned checkpoints (io.recycle); CPU = whole process from Save() to "
              "commit.\n");
  return 0;
}
