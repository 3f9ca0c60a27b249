// ckptio: the command-line tool. Until the checkpoint layers land, `demo`
// exercises the runtime: it writes a state-sized file through the io_uring
// loop with O_DIRECT and several writes in flight, the way shards will go.

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

#include "ckptio/task.h"
#include "runtime/block_writer.h"
#include "runtime/io_ops.h"
#include "runtime/loop.h"

namespace ckptio::cli {
namespace {

using runtime::File;
using runtime::Loop;

constexpr const char* kUsage =
    "usage: ckptio <command> [options]\n"
    "\n"
    "commands:\n"
    "  demo [--state-size MiB] [--dir DIR]   write a state-sized file through the io_uring loop\n";

Task<Status> WriteState(Loop& loop, std::string dir, const char* data, size_t len) {
  const std::string tmp = dir + "/state.bin.tmp";
  const std::string final_path = dir + "/state.bin";
  CO_ASSIGN_OR_RETURN(File f, co_await loop.OpenAt(AT_FDCWD, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT));
  CO_TRY(co_await loop.Fallocate(f, 0, 0, len));
  CO_TRY(co_await runtime::WriteInBlocks(loop, &f, data, len, 0, 4 << 20, 8));
  CO_TRY(co_await loop.Fsync(f));
  CO_TRY(co_await loop.Close(f));
  CO_TRY(co_await loop.RenameAt(AT_FDCWD, tmp, AT_FDCWD, final_path));
  CO_ASSIGN_OR_RETURN(File d, co_await loop.OpenAt(AT_FDCWD, dir, O_RDONLY | O_DIRECTORY));
  CO_TRY(co_await loop.Fsync(d));
  co_return co_await loop.Close(d);
}

int Demo(int argc, char** argv) {
  size_t mib = 1024;
  std::string dir = "ckptio-demo";
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--state-size" && i + 1 < argc) {
      mib = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--dir" && i + 1 < argc) {
      dir = argv[++i];
    } else {
      std::fputs(kUsage, stderr);
      return 1;
    }
  }
  std::filesystem::create_directories(dir);
  auto loop = Loop::Create();
  if (!loop.ok()) {
    std::fprintf(stderr, "ckptio: %s\n", loop.status().message().c_str());
    return 2;
  }
  const size_t len = mib << 20;
  void* raw = nullptr;
  if (posix_memalign(&raw, 4096, len) != 0) return 2;
  std::unique_ptr<char, decltype(&std::free)> buf(static_cast<char*>(raw), &std::free);
  std::memset(buf.get(), 0x5a, len);
  auto start = std::chrono::steady_clock::now();
  Status s = (*loop)->Run(WriteState(**loop, dir, buf.get(), len));
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (!s.ok()) {
    std::fprintf(stderr, "ckptio: %s\n", s.message().c_str());
    return 2;
  }
  std::printf("wrote %zu MiB to %s/state.bin in %.2f s (%.2f GB/s), io_uring %s, %llu SQEs\n", mib,
              dir.c_str(), secs, len / secs / 1e9, (*loop)->setup_mode(),
              static_cast<unsigned long long>((*loop)->stats().sqes));
  return 0;
}

}  // namespace
}  // namespace ckptio::cli

int main(int argc, char** argv) {
  if (argc >= 2 && std::strcmp(argv[1], "demo") == 0) return ckptio::cli::Demo(argc - 2, argv + 2);
  std::fputs(ckptio::cli::kUsage, argc >= 2 && std::strcmp(argv[1], "--help") == 0 ? stdout : stderr);
  return argc >= 2 && std::strcmp(argv[1], "--help") == 0 ? 0 : 1;
}
