#pragma once
// Helpers shared by the unit tests: a scratch directory, a lifetime-counting
// type, and the small Options most manager tests start from.

#include <stdlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

#include "ckptio/options.h"

namespace ckptio::testing {

// A fresh directory under $TMPDIR (or /tmp), removed with its contents on
// destruction.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string tmpl = std::string(base && *base ? base : "/tmp") + "/ckptio-test-XXXXXX";
    if (mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

inline std::string ReadWholeFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

inline void WriteWholeFile(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Options for a manager in a test: 1 MiB shards (so a few MB of tensors make
// several), every checkpoint kept, two CPU threads, and `staging_memory`
// bytes of staging (pre-faulted at Open: keep it small).
inline Options SmallOptions(uint64_t staging_memory = uint64_t{16} << 20) {
  Options o;
  o.staging_memory = staging_memory;
  o.shard_size = 1 << 20;
  o.keep = 0;
  o.threads = 2;
  return o;
}

// Counts constructions and destructions, to check that coroutine frames
// destroy what they own exactly once.
struct Counted {
  static inline int constructed = 0;
  static inline int destroyed = 0;
  static void Reset() { constructed = destroyed = 0; }
  static int alive() { return constructed - destroyed; }

  Counted() { ++constructed; }
  Counted(const Counted&) { ++constructed; }
  Counted(Counted&& o) noexcept : moved_from(false) {
    o.moved_from = true;
    ++constructed;
  }
  ~Counted() { ++destroyed; }
  bool moved_from = false;
};

}  // namespace ckptio::testing
