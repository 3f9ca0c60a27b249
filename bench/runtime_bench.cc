// bench/runtime_bench: the coroutine runtime and the io_uring Loop against
// the machine's limits (fio on the same file system, pwrite in a loop).
//
//   runtime_bench [--dir DIR] [--size-mib N] [--rounds R] [--skip-fio]
//
// Prints markdown tables; ratios > 1 mean ckptio is faster.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "bench_util.h"
#include "runtime/sync_wait.h"
#include "runtime/task.h"
#include "runtime/block_writer.h"
#include "runtime/io_ops.h"
#include "runtime/loop.h"

namespace ckptio::bench {
namespace {

using runtime::File;
using runtime::Loop;

struct Args {
  std::string dir = "bench/results/tmp";
  size_t size_mib = 2048;
  int rounds = 3;
  bool fio = true;
};

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&] { return FlagValue("runtime_bench", argc, argv, &i); };
    if (s == "--dir") a.dir = next();
    else if (s == "--size-mib") a.size_mib = std::stoul(next());
    else if (s == "--rounds") a.rounds = std::stoi(next());
    else if (s == "--skip-fio") a.fio = false;
    else {
      std::fprintf(stderr, "usage: runtime_bench [--dir DIR] [--size-mib N] [--rounds R] [--skip-fio]\n");
      std::exit(s == "--help" ? 0 : 1);
    }
  }
  return a;
}

Task<int> Immediate(int v) { co_return v; }

Task<long> AwaitMany(long n) {
  long sum = 0;
  for (long i = 0; i < n; ++i) sum += co_await Immediate(static_cast<int>(i & 1));
  co_return sum;
}

double NsPerCompletedAwait() {
  constexpr long kN = 20'000'000;
  SyncWait(AwaitMany(kN / 10));  // warm the allocator
  Phase p;
  long sum = SyncWait(AwaitMany(kN));
  double ns = p.wall() * 1e9 / kN;
  if (sum != kN / 2) std::fprintf(stderr, "unexpected sum %ld\n", sum);
  return ns;
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(2);
  }
}

Task<Status> OpenCreate(Loop& loop, std::string path, int flags, File* out) {
  CO_ASSIGN_OR_RETURN(*out, co_await loop.OpenAt(AT_FDCWD, path, O_WRONLY | O_CREAT | O_TRUNC | flags));
  co_return Status::Ok();
}

// Sequential O_DIRECT write through the Loop: fallocate, write at `depth`, fdatasync.
Task<Status> DirectWrite(Loop& loop, std::string path, const char* buf, size_t len, size_t block,
                         int depth, Rate* rate) {
  File f;
  CO_TRY(co_await OpenCreate(loop, path, O_DIRECT, &f));
  CO_TRY(co_await loop.Fallocate(f, 0, 0, len));
  Phase p;
  CO_TRY(co_await runtime::WriteInBlocks(loop, &f, buf, len, 0, block, depth));
  CO_TRY(co_await loop.Fsync(f, /*datasync=*/true));
  rate->seconds = p.wall();
  rate->cpu = p.cpu();
  rate->bytes = static_cast<double>(len);
  co_return co_await loop.Close(f);
}

Rate Median(std::vector<Rate> v) {
  std::sort(v.begin(), v.end(), [](const Rate& a, const Rate& b) { return a.gbps() < b.gbps(); });
  return v[v.size() / 2];
}

// 4 KiB buffered writes of a 64 MiB file, `passes` times: io_uring at a queue
// depth vs pwrite in a loop.
double IoUringSmallWritesPerSecond(Loop& loop, const std::string& path, const char* buf, int depth) {
  constexpr size_t kFile = 64 << 20;
  auto body = [](Loop& l, std::string p, const char* b, int d) -> Task<Status> {
    File f;
    CO_TRY(co_await OpenCreate(l, p, 0, &f));
    for (int pass = 0; pass < 4; ++pass) CO_TRY(co_await runtime::WriteInBlocks(l, &f, b, kFile, 0, 4096, d));
    co_return co_await l.Close(f);
  };
  Phase p;
  Check(loop.Run(body(loop, path, buf, depth)), "io_uring 4 KiB writes");
  double secs = p.wall();
  ::unlink(path.c_str());
  return 4.0 * kFile / 4096 / secs;
}

double PwriteSmallWritesPerSecond(const std::string& path, const char* buf) {
  constexpr size_t kFile = 64 << 20;
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  Phase p;
  for (int pass = 0; pass < 4; ++pass) {
    for (size_t off = 0; off < kFile; off += 4096) {
      if (::pwrite(fd, buf + off, 4096, static_cast<off_t>(off)) != 4096) std::exit(2);
    }
  }
  double secs = p.wall();
  ::close(fd);
  ::unlink(path.c_str());
  return 4.0 * kFile / 4096 / secs;
}

}  // namespace
}  // namespace ckptio::bench

int main(int argc, char** argv) {
  using namespace ckptio::bench;
  Args args = ParseArgs(argc, argv);
  std::filesystem::create_directories(args.dir);
  auto loop_or = ckptio::runtime::Loop::Create();
  if (!loop_or.ok()) {
    std::fprintf(stderr, "%s\n", loop_or.status().ToString().c_str());
    return 2;
  }
  auto& loop = **loop_or;
  std::printf("## Runtime benchmark\n\n%s; io_uring %s; files in %s\n\n", MachineLine().c_str(),
              loop.setup_mode(), args.dir.c_str());

  Table coro({"measurement", "result"});
  coro.Add({"co_await of a task that completes at once (frame alloc + resume + free)",
            Fmt("%.1f ns", NsPerCompletedAwait())});
  coro.Print();
  std::printf("\n");

  const std::string small_path = args.dir + "/small.bin";
  AlignedBuffer small = WarmBuffer(64 << 20, 3);
  double pw = PwriteSmallWritesPerSecond(small_path, small.get());
  Table smallt({"4 KiB buffered writes, 64 MiB file x4", "ops/s", "vs pwrite loop"});
  smallt.Add({"pwrite in a loop", Fmt("%.0f", pw), "1.00x"});
  for (int depth : {1, 32}) {
    double ops = IoUringSmallWritesPerSecond(loop, small_path, small.get(), depth);
    smallt.Add({"io_uring Loop, queue depth " + std::to_string(depth), Fmt("%.0f", ops),
                Fmt("%.2fx", ops / pw)});
  }
  smallt.Print();
  std::printf("\n");

  const size_t len = args.size_mib << 20;
  AlignedBuffer buf = WarmBuffer(len, 7);
  const std::string path = args.dir + "/direct.bin";
  Table t({"O_DIRECT sequential write, QD 8", "ckptio GB/s", "fio GB/s", "ratio", "ckptio CPU s/GiB",
           "fio CPU s/GiB", "ckptio % of a core"});
  for (size_t block : {size_t{1} << 20, size_t{4} << 20}) {
    std::vector<Rate> theirs;  // fio, measured in the rounds of the first row
    for (bool fixed : {false, true}) {
      if (fixed) {
        iovec region{buf.get(), len};
        Check(loop.RegisterBuffers({&region, 1}), "register buffers");
      }
      std::vector<Rate> ours;
      for (int r = 0; r < args.rounds; ++r) {
        Rate rate;
        Check(loop.Run(DirectWrite(loop, path, buf.get(), len, block, 8, &rate)), "direct write");
        ::unlink(path.c_str());
        ours.push_back(rate);
        if (args.fio && !fixed) theirs.push_back(FioWrite(path, len, block, 8));
      }
      if (fixed) loop.UnregisterBuffers();
      Rate o = Median(ours);
      std::string label = std::to_string(block >> 20) + " MiB blocks" + (fixed ? ", registered buffers" : "");
      if (!theirs.empty()) {
        Rate f = Median(theirs);
        t.Add({label, Fmt("%.3f", o.gbps()), Fmt("%.3f", f.gbps()), Fmt("%.2fx", o.gbps() / f.gbps()),
               Fmt("%.3f", o.cpu_per_gib()), Fmt("%.3f", f.cpu_per_gib()), Fmt("%.1f%%", 100 * o.core_fraction())});
      } else {
        t.Add({label, Fmt("%.3f", o.gbps()), "-", "-", Fmt("%.3f", o.cpu_per_gib()), "-",
               Fmt("%.1f%%", 100 * o.core_fraction())});
      }
    }
  }
  t.Print();
  std::printf("\n%zu MiB per run, median of %d runs, fio 'ioengine=io_uring direct=1 rw=write "
              "iodepth=8 fallocate=native end_fsync=1' on the same file system in the same run.\n",
              args.size_mib, args.rounds);
  return 0;
}
