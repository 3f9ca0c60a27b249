#pragma once
// Helpers shared by the unit tests: a scratch directory and a lifetime-counting type.

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

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
