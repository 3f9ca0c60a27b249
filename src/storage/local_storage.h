#pragma once
// LocalStorage: checkpoints in a directory of a local file system, written
// through the io_uring Loop.
//
// Commit protocol (each step must be durable before the next, so a crash at
// any point leaves either the previous state or the new checkpoint):
//   mkdir <name>.tmp-<nonce>            in-flight checkpoints are invisible
//   write each file, fdatasync it       O_DIRECT (bounce buffers for the
//                                       bytes not block-aligned in memory)
//   write manifest.json, fsync it
//   fsync the tmp dir                   its entries are durable
//   rename tmp -> <name>                the checkpoint appears at once
//   fsync the root                      the rename is durable
// Removal renames <name> to <name>.tmp-del-<nonce> first (the checkpoint
// disappears at once), then deletes the files. Anything named *.tmp-* is
// debris that the writer removes when it takes the root's lock.
// Recycling (LocalOptions::recycle): Prune, instead of deleting the files,
// renames them into <root>/.recycle (when it is empty), and the next
// checkpoint's WriteFile renames one of them into its tmp dir and overwrites
// it (then truncates it to size) instead of creating a file. The files are
// only ever visible under tmp names or in .recycle, which readers never list.

#include <memory>
#include <string>

#include "ckptio/options.h"
#include "runtime/async_sync.h"
#include "runtime/cpu_pool.h"
#include "runtime/loop.h"
#include "storage/storage.h"

namespace ckptio::storage {

struct LocalOptions {
  Options::Io::Direct direct = Options::Io::Direct::kAuto;
  size_t block_size = size_t{4} << 20;
  int queue_depth = 8;  // writes in flight across all files of this storage
  bool recycle = true;  // Prune keeps files in <root>/.recycle for later writes
};

// Opens the directory `root`, creating it and its parents if `create`
// (else NotFound names a missing root).
Task<Result<std::unique_ptr<Storage>>> OpenLocalStorage(runtime::Loop& loop, runtime::CpuPool& pool,
                                                        std::string root, LocalOptions options, bool create);

// Test hook: hears of every change LocalStorage makes to the file system,
// right after it is made, in order. Power-loss tests rebuild from it what a
// disk keeps when power fails (what was synced, and nothing else). It can
// also make an operation fail as a failing disk would (Inject): the test
// double for EIO and ENOSPC at a chosen write, fsync or rename. Paths are
// relative to the root ("" is the root). Calls come from the loop thread and
// the CPU pool: an observer must be thread-safe.
class FsObserver {
 public:
  enum class Op { kWrite, kSync, kRename };
  virtual ~FsObserver() = default;
  // Before `op` on `path`: an errno to fail it with instead, or 0 to proceed.
  virtual int Inject(Op op, const std::string& path) {
    (void)op, (void)path;
    return 0;
  }
  // Each change, after it is made; an observer overrides what it follows.
  virtual void MadeDir(const std::string& path) { (void)path; }
  virtual void CreatedFile(const std::string& path) { (void)path; }
  // fsync or fdatasync of a file or directory
  virtual void Synced(const std::string& path) { (void)path; }
  virtual void Renamed(const std::string& from, const std::string& to, bool exchange) {
    (void)from, (void)to, (void)exchange;
  }
  virtual void Removed(const std::string& path) { (void)path; }  // unlink or rmdir
  // A shard's data is written (not yet synced): with O_DIRECT or not, and
  // how many of its bytes went through bounce buffers on the way.
  virtual void Wrote(const std::string& path, bool direct, uint64_t bounced) { (void)path, (void)direct, (void)bounced; }
};
// Installs the observer of every LocalStorage opened afterwards (null: none).
void SetFsObserverForTesting(FsObserver* observer);

}  // namespace ckptio::storage
