#pragma once
// Plain synchronous file helpers for the CLI's own inputs and outputs (the
// checkpoints themselves go through the manager): a read-only mapping of an
// input file, and a durable write-then-rename of an output file.

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>

#include "ckptio/status.h"

namespace ckptio::cli {

// A whole file mapped read-only (MAP_PRIVATE, so later writes by others to
// the file are not promised to stay invisible: the caller treats the bytes as
// untrusted and reads them while it holds the mapping). Move-only; unmaps on
// destruction. An empty file maps to an empty span. Only a regular file is
// mapped (a FIFO is refused without waiting for a writer).
//
// A file that another process truncates while it is mapped raises SIGBUS at
// the next read of its lost pages, on whichever thread reads them. While any
// MappedFile is alive, a SIGBUS inside one of them ends the process with
// "ckptio: FILE shrank while it was being read ..." and exit status 1
// (kExitUsage) instead of a crash; a SIGBUS elsewhere stays a crash. The
// checkpoint being written is then never committed (its tmp directory is
// debris that the next writer removes).
class MappedFile {
 public:
  static Result<MappedFile> Open(const std::string& path);
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  std::span<const uint8_t> bytes() const { return {data_, size_}; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size) : path_(std::move(path)), data_(data), size_(size) {}
  void Unmap();

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int slot_ = -1;  // in the SIGBUS handler's table of mappings
};

// Called with (bytes written so far, total bytes).
using WriteProgressFn = std::function<void(uint64_t done, uint64_t total)>;

// Writes the concatenation of `pieces` to `path` durably and atomically:
// into path + ".tmp", fsync, rename over `path`, fsync of the directory. On
// failure the tmp file is removed and `path` is left as it was.
Status WriteFileAtomically(const std::string& path, std::span<const std::span<const std::byte>> pieces,
                           const WriteProgressFn& progress = {});

}  // namespace ckptio::cli
