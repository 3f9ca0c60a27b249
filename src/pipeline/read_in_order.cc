// ManagerImpl::ReadInOrder: a whole checkpoint, tensor by tensor, through two
// reused windows of memory (see CheckpointManager::ReadInOrder).
//
// Reads run on the loop thread (and CRC32C on the pool) into one window
// while the caller's thread hands the other to the reader: for an export the
// disk reads and the output writes overlap, and memory stays 2 x window
// whatever the checkpoint's size (a 4 GiB export used to restore the whole
// checkpoint into fresh memory first: 21 s of page faults for 2.5 s of reads).

#include <algorithm>
#include <future>
#include <memory>

#include "base/status_macros.h"
#include "format/crc32c.h"
#include "pipeline/manager_impl.h"
#include "pipeline/reader.h"
#include "runtime/spawn.h"

namespace ckptio::pipeline {

// One window of pieces on its way in.
struct ManagerImpl::WindowRead {
  std::vector<TensorPieceRead> reads;
  std::vector<uint32_t> crcs;
  std::promise<Status> done;
};

namespace {

constexpr uint64_t kMaxPiece = uint64_t{16} << 20;  // one read request (the reader's lanes run 8 at once)

// The pieces of every tensor in saved order, each at most `piece` bytes,
// grouped into windows of at most `window` bytes.
std::vector<std::vector<TensorPieceRead>> PlanWindows(const format::Manifest& m, uint64_t window) {
  const uint64_t piece = std::min(kMaxPiece, window);
  std::vector<std::vector<TensorPieceRead>> windows(1);
  uint64_t filled = 0;
  for (size_t t = 0; t < m.tensors.size(); ++t) {
    for (uint64_t off = 0; off < m.tensors[t].bytes; off += piece) {
      const size_t len = static_cast<size_t>(std::min(piece, m.tensors[t].bytes - off));
      if (filled + len > window) {
        windows.emplace_back();
        filled = 0;
      }
      windows.back().push_back({t, off, len, nullptr});
      filled += len;
    }
  }
  if (windows.back().empty()) windows.pop_back();
  return windows;
}

}  // namespace

Task<void> ManagerImpl::RunWindow(OpenedCheckpoint* ckpt, WindowRead* w) {
  Status s = co_await ReadTensorPieces(pool_.get(), ckpt, &w->reads, &w->crcs);
  w->done.set_value(std::move(s));
}

std::future<Status> ManagerImpl::StartWindow(OpenedCheckpoint* ckpt, WindowRead* w) {
  std::future<Status> f = w->done.get_future();
  ManagerImpl* self = this;
  loop().Post([self, ckpt, w] { runtime::Spawn(self->RunWindow(ckpt, w)); });
  return f;
}

Status ManagerImpl::ReadInOrderPinned(int64_t step, const OrderedReader& reader, uint64_t window) {
  window = std::clamp<uint64_t>(window, uint64_t{1} << 20, uint64_t{1} << 30);
  ASSIGN_OR_RETURN(OpenedCheckpoint c, loop().BlockOn(OpenStep(step)));
  const format::Manifest& m = c.manifest;
  std::vector<TensorInfo> tensors;
  tensors.reserve(m.tensors.size());
  for (const format::ManifestTensor& t : m.tensors) tensors.push_back({t.name, t.dtype, t.shape, t.bytes, t.chunk});
  if (reader.begin) RETURN_IF_ERROR(reader.begin(step, m.metadata.dump(), tensors));

  std::vector<std::vector<TensorPieceRead>> plan = PlanWindows(m, window);
  std::unique_ptr<char[]> buffers[2];
  WindowRead reads[2];
  std::future<Status> pending[2];
  auto start = [&](size_t k) {
    const size_t b = k % 2;
    if (!buffers[b]) buffers[b].reset(new char[window]);
    reads[b] = WindowRead{};
    reads[b].reads = std::move(plan[k]);
    char* dst = buffers[b].get();
    for (TensorPieceRead& r : reads[b].reads) {
      r.dst = dst;
      dst += r.len;
    }
    pending[b] = StartWindow(&c, &reads[b]);
  };
  std::vector<uint32_t> crc(m.tensors.size(), 0);
  std::vector<uint64_t> done(m.tensors.size(), 0);
  Status status;
  if (!plan.empty()) start(0);
  for (size_t k = 0; k < plan.size() && status.ok(); ++k) {
    const size_t b = k % 2;
    status = pending[b].get();
    if (!status.ok()) break;  // nothing else is in flight
    // Keep the disk busy while this window is handed over.
    const bool next = k + 1 < plan.size();
    if (next) start(k + 1);
    const WindowRead& w = reads[b];
    for (size_t i = 0; i < w.reads.size() && status.ok(); ++i) {
      const TensorPieceRead& r = w.reads[i];
      crc[r.tensor] = done[r.tensor] == 0 ? w.crcs[i] : format::Crc32cCombine(crc[r.tensor], w.crcs[i], r.len);
      done[r.tensor] += r.len;
      if (done[r.tensor] == m.tensors[r.tensor].bytes && crc[r.tensor] != m.tensors[r.tensor].crc32c) {
        status = TensorCrcMismatch(c, r.tensor, crc[r.tensor]);  // before its last piece is handed over
      } else if (reader.piece) {
        status = reader.piece(r.tensor, r.offset, std::as_bytes(std::span<const char>(r.dst, r.len)));
      }
    }
    // Stopping: the next window reads into memory we own; let it land.
    if (!status.ok() && next) pending[(k + 1) % 2].get().IgnoreError();
  }
  // The shards close on the loop thread, where they were opened.
  loop().BlockOn(CloseCheckpoint(std::move(c)));
  return status;
}

Task<void> ManagerImpl::CloseCheckpoint(OpenedCheckpoint c) {
  c.shards.clear();
  co_return;
}

Result<int64_t> ManagerImpl::ReadInOrder(std::optional<int64_t> step, const OrderedReader& reader, uint64_t window) {
  ReadHold hold(this);
  ASSIGN_OR_RETURN(int64_t s, PinStep(step));
  Status st = ReadInOrderPinned(s, reader, window);
  Unpin(s);
  RETURN_IF_ERROR(ExplainReadFailure(s, std::move(st)));
  return s;
}

}  // namespace ckptio::pipeline
