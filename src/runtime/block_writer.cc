#include "runtime/block_writer.h"

#include <algorithm>
#include <vector>

#include "runtime/when_all.h"
#include "runtime/io_ops.h"

namespace ckptio::runtime {
namespace {

struct Shared {
  Loop* loop;
  const File* file;
  const char* data;
  size_t len;
  uint64_t offset;
  size_t block;
  AsyncSemaphore* shared_depth;
  std::atomic<uint64_t>* progress;
  size_t next = 0;  // next byte of data to hand out
  Status first_error;
};

// One of `depth` lanes: takes the next block until none is left or a lane failed.
Task<void> Lane(Shared* s) {
  while (s->next < s->len && s->first_error.ok()) {
    size_t pos = s->next;
    size_t n = std::min(s->block, s->len - pos);
    s->next += n;
    if (s->shared_depth != nullptr) co_await s->shared_depth->Acquire();
    Status st = co_await s->loop->Write(*s->file, s->data + pos, n, s->offset + pos);
    if (s->shared_depth != nullptr) s->shared_depth->Release();
    if (!st.ok() && s->first_error.ok()) s->first_error = std::move(st);
    if (st.ok() && s->progress != nullptr) s->progress->fetch_add(n, std::memory_order_relaxed);
  }
}

}  // namespace

Task<Status> WriteInBlocks(Loop& loop, const File* file, const char* data, size_t len,
                           uint64_t offset, size_t block, int depth, AsyncSemaphore* shared_depth,
                           std::atomic<uint64_t>* progress) {
  Shared shared{&loop, file, data, len, offset, std::max<size_t>(block, 1), shared_depth, progress, 0, Status::Ok()};
  size_t blocks = (len + shared.block - 1) / shared.block;
  size_t lanes = std::min<size_t>(std::max(depth, 1), std::max<size_t>(blocks, 1));
  std::vector<Task<void>> tasks;
  tasks.reserve(lanes);
  for (size_t i = 0; i < lanes; ++i) tasks.push_back(Lane(&shared));
  co_await WhenAll(std::move(tasks));
  co_return std::move(shared.first_error);
}

}  // namespace ckptio::runtime
