#pragma once
// WriteInBlocks: write one contiguous buffer to a file as fixed-size writes
// with several in flight, the way staged shard images go to disk.

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "ckptio/status.h"
#include "runtime/task.h"
#include "runtime/async_sync.h"
#include "runtime/loop.h"

namespace ckptio::runtime {

// Writes [data, data + len) to `*file` starting at file offset `offset`, as
// writes of `block` bytes (the last one may be shorter) with at most `depth`
// in flight. For O_DIRECT files, data, offset and block must be aligned to
// the device's logical block size, and so must len unless the file is
// extended past it later. Returns the first error; writes already issued are
// awaited before returning, so the buffer may be reused afterwards.
// If `shared_depth` is given, every write also holds one of its permits, so
// several files written at once share one bound on writes in flight. If
// `progress` is given, each completed write adds its bytes to it (readable
// from any thread).
// REQUIRES: *file, the buffer, *shared_depth and *progress outlive the task.
Task<Status> WriteInBlocks(Loop& loop, const File* file, const char* data, size_t len,
                           uint64_t offset, size_t block, int depth,
                           AsyncSemaphore* shared_depth = nullptr,
                           std::atomic<uint64_t>* progress = nullptr);

}  // namespace ckptio::runtime
