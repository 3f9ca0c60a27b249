#pragma once
// Small helpers shared by the benchmark programs: timing, CPU accounting,
// aligned warm buffers, markdown tables, running fio.

#include <sys/resource.h>
#include <sys/utsname.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

namespace ckptio::bench {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The value of the flag at argv[*i] (advancing *i past it), for a command
// line parsed flag by flag; exits naming `program` and the flag if the
// command line ends first.
inline std::string FlagValue(const char* program, int argc, char** argv, int* i) {
  if (*i + 1 >= argc) {
    std::fprintf(stderr, "%s: %s needs a value\n", program, argv[*i]);
    std::exit(1);
  }
  return argv[++*i];
}

// CPU time (user + system) consumed by the whole process so far, in seconds:
// includes io_uring's io-wq workers, which run as threads of this process.
inline double ProcessCpuSeconds() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  auto tv = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return tv(ru.ru_utime) + tv(ru.ru_stime);
}

inline long PeakRssKiB() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_maxrss;
}

// Measures wall and process CPU time of a phase.
class Phase {
 public:
  Phase() : wall0_(Clock::now()), cpu0_(ProcessCpuSeconds()) {}
  double wall() const { return Seconds(Clock::now() - wall0_); }
  double cpu() const { return ProcessCpuSeconds() - cpu0_; }

 private:
  Clock::time_point wall0_;
  double cpu0_;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<char, FreeDeleter>;

// A 4 KiB-aligned buffer, filled with a non-trivial pattern (so every page is
// touched before timing starts and compression could not cheat).
inline AlignedBuffer WarmBuffer(size_t len, unsigned seed = 1) {
  void* p = nullptr;
  if (posix_memalign(&p, 4096, len) != 0) {
    std::fprintf(stderr, "out of memory allocating %zu bytes\n", len);
    std::exit(1);
  }
  auto* c = static_cast<uint64_t*>(p);
  uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
  for (size_t i = 0; i < len / 8; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    c[i] = x;
  }
  return AlignedBuffer(static_cast<char*>(p));
}

inline std::string Fmt(const char* f, double v) {
  char b[64];
  std::snprintf(b, sizeof b, f, v);
  return b;
}

// Collects rows and prints a markdown table.
class Table {
 public:
  explicit Table(std::vector<std::string> header) : header_(std::move(header)) {}
  void Add(std::vector<std::string> row) { rows_.push_back(std::move(row)); }
  void Print(FILE* out = stdout) const {
    auto line = [&](const std::vector<std::string>& r) {
      std::fputs("|", out);
      for (const auto& c : r) std::fprintf(out, " %s |", c.c_str());
      std::fputs("\n", out);
    };
    line(header_);
    std::fputs("|", out);
    for (size_t i = 0; i < header_.size(); ++i) std::fputs("---|", out);
    std::fputs("\n", out);
    for (const auto& r : rows_) line(r);
    std::fflush(out);
  }

 private:
  std::vector<std::string> header_;
  std::vector<std::vector<std::string>> rows_;
};

inline std::string MachineLine() {
  utsname u{};
  uname(&u);
  std::string cpu = "unknown cpu";
  if (FILE* f = std::fopen("/proc/cpuinfo", "r")) {
    char line[512];
    while (std::fgets(line, sizeof line, f)) {
      if (std::strncmp(line, "model name", 10) == 0) {
        const char* c = std::strchr(line, ':');
        if (c) cpu = std::string(c + 2, std::strcspn(c + 2, "\n"));
        break;
      }
    }
    std::fclose(f);
  }
  return std::string("Linux ") + u.release + ", " + cpu + ", " +
         std::to_string(std::thread::hardware_concurrency()) + " cpus";
}

// Runs a shell command, returns its stdout (empty on failure).
inline std::string RunCommand(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

// Result of one write phase.
struct Rate {
  double seconds = 0;
  double cpu = 0;
  double bytes = 0;
  double gbps() const { return bytes / seconds / 1e9; }
  double cpu_per_gib() const { return cpu / (bytes / double(1 << 30)); }
  double core_fraction() const { return cpu / seconds; }
};

// With `rewrite`, a first unmeasured pass lays the file out and the measured
// one overwrites its written blocks (as ckptio does into recycled files).
inline Rate FioWrite(const std::string& path, size_t len, size_t block, int depth, bool rewrite = false) {
  std::string cmd = "fio --name=w --filename=" + path + " --ioengine=io_uring --direct=1 --rw=write" +
                    " --bs=" + std::to_string(block) + " --iodepth=" + std::to_string(depth) +
                    " --size=" + std::to_string(len) +
                    " --fallocate=native --end_fsync=1 --output-format=json 2>/dev/null";
  if (rewrite) RunCommand(cmd);
  std::string out = RunCommand(cmd);
  Rate r;
  try {
    auto j = nlohmann::json::parse(out.substr(out.find('{')));
    const auto& job = j["jobs"][0];
    double runtime_s = job["job_runtime"].get<double>() / 1000.0;
    r.bytes = job["write"]["io_bytes"].get<double>();
    r.seconds = job["write"]["runtime"].get<double>() / 1000.0;
    r.cpu = (job["usr_cpu"].get<double>() + job["sys_cpu"].get<double>()) / 100.0 * runtime_s;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "could not run or parse fio (%s): %s\n", e.what(), cmd.c_str());
  }
  ::unlink(path.c_str());
  return r;
}

}  // namespace ckptio::bench
