#include "pipeline/reader.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <utility>
#include <map>
#include <memory>

#include "base/align.h"
#include "base/status_macros.h"
#include "runtime/when_all.h"
#include "format/crc32c.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace ckptio::pipeline {
namespace {

constexpr size_t kPiece = size_t{16} << 20;
constexpr size_t kLanes = 8;

// A range of one shard file to read and checksum. tensor < 0: not part of a
// tensor (the header). dst null: read into the lane's own buffer. A scattered
// piece (first_part < last_part, dst null) reads into its parts in turn.
struct Piece {
  size_t shard;
  uint64_t offset;
  size_t len;
  char* dst;
  int64_t tensor;
  size_t first_part = 0, last_part = 0;
};

// A run of a scattered piece's bytes: into dst, or (null) into the lane's own
// buffer, only to be checked.
struct Part {
  uint64_t len;
  char* dst;
};

struct PieceWork {
  runtime::CpuPool* pool;
  OpenedCheckpoint* ckpt;
  const std::vector<Piece>* pieces;
  const std::vector<Part>* parts;  // null where no piece is scattered
  std::vector<uint32_t>* crcs;
  const ProgressFn* progress;
  uint64_t total;
  uint64_t done = 0;
  size_t next = 0;
  // Of each piece, whether its memory was populated (or is being): by
  // PopulateAhead, or by the lane that took it first.
  std::vector<bool> populated;
  Status first_error;
};

// A lane's own memory: aligned for O_DIRECT, on huge pages where the kernel
// gives them (a lane's 4 MiB bounce buffer is then two page faults, not a
// thousand), allocated once per read of a checkpoint and reused by each of
// the lane's pieces.
class LaneBuffer {
 public:
  ~LaneBuffer() { std::free(p_); }
  char* get(size_t bytes) {
    if (p_ == nullptr) {
      bytes = (bytes + kHugePage - 1) / kHugePage * kHugePage;
      p_ = static_cast<char*>(std::aligned_alloc(kHugePage, bytes));
      if (p_ == nullptr) throw std::bad_alloc();
      (void)::madvise(p_, bytes, MADV_HUGEPAGE);
    }
    return p_;
  }

 private:
  static constexpr size_t kHugePage = size_t{2} << 20;
  char* p_ = nullptr;
};

// Reads of a file that reads around the page cache (ReadableFile::
// PrefersBounce) into memory that does not agree with it in alignment go
// through the lane's bounce buffer, kWindow at a time, and are copied out
// (with the CRC, block by block while the bytes are in cache): cheaper than
// the page cache's copy, and no cache the size of the state. Below
// kBounceFrom, the read goes through the page cache.
constexpr size_t kBounceFrom = size_t{64} << 10;
constexpr size_t kWindow = size_t{4} << 20;
constexpr size_t kCopyBlock = size_t{256} << 10;
// A plain read of this much into the caller's memory first has its pages
// faulted in on the CPU pool (MADV_POPULATE_WRITE): a read around the page
// cache pins its pages on the loop thread, which would fault each fresh 4
// KiB page there (~17 us each on this VM) with the other lanes' reads
// waiting behind it.
constexpr size_t kPopulateFrom = size_t{1} << 20;

constexpr size_t kPage = 4096;

void Populate(char* p, size_t len) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  const uintptr_t from = base::RoundUp(at, kPage), to = base::RoundDown(at + len, kPage);
  // Errors ignored (a kernel before 5.14, memory that is not anonymous): the
  // read faults the pages in itself.
  if (to > from) (void)::madvise(reinterpret_cast<void*>(from), to - from, MADV_POPULATE_WRITE);
}

// Copies the window [at, at + n) of a piece's bytes, read into `src`, out to
// the piece's spans (the bytes of a null span are only checked), and
// extends `crc` over them.
uint32_t CrcAndCopyOut(uint32_t crc, const char* src, const std::vector<struct iovec>& spans, uint64_t at, size_t n) {
  uint64_t pos = 0;  // of spans[k] in the piece
  for (const struct iovec& v : spans) {
    const uint64_t from = std::max<uint64_t>(pos, at), to = std::min<uint64_t>(pos + v.iov_len, at + n);
    for (uint64_t b = from; b < to; b += kCopyBlock) {
      const size_t len = static_cast<size_t>(std::min<uint64_t>(kCopyBlock, to - b));
      const char* s = src + (b - at);
      crc = format::Crc32cExtend(crc, s, len);
      if (v.iov_base != nullptr) std::memcpy(static_cast<char*>(v.iov_base) + (b - pos), s, len);
    }
    pos += v.iov_len;
    if (pos >= at + n) break;
  }
  return crc;
}

Task<void> PieceLane(PieceWork* w) {
  LaneBuffer own, bounce;
  std::vector<struct iovec> iov, spans;  // spans: iov as it was before the read advanced it
  while (w->next < w->pieces->size() && w->first_error.ok()) {
    size_t i = w->next++;
    const Piece& p = (*w->pieces)[i];
    storage::ReadableFile* f = w->ckpt->shards[p.shard].get();
    const bool scattered = p.last_part > p.first_part;
    Status s;
    spans.clear();
    if (f->PrefersBounce() && p.len >= kBounceFrom &&
        (scattered || (p.dst != nullptr && !f->ReadsDirect(p.offset, p.dst, p.len)))) {
      if (scattered) {
        for (size_t k = p.first_part; k < p.last_part; ++k) spans.push_back({(*w->parts)[k].dst, (*w->parts)[k].len});
      } else {
        spans.push_back({p.dst, p.len});
      }
      uint32_t crc = 0;
      // The window and its slack fill the buffer's two huge pages exactly (a
      // window of kWindow took three: 48 MiB over the 8 lanes, not 32).
      constexpr size_t kBounced = kWindow - 2 * storage::ReadableFile::kBounceSlack;
      for (uint64_t at = 0; at < p.len && s.ok(); at += kBounced) {
        const size_t n = static_cast<size_t>(std::min<uint64_t>(kBounced, p.len - at));
        Result<const char*> src = co_await f->ReadAtBounced(p.offset + at, n, bounce.get(kWindow));
        if (!src.ok()) {
          s = src.status();
          break;
        }
        auto copy_out = [crc, from = *src, &spans, at, n] { return CrcAndCopyOut(crc, from, spans, at, n); };
        crc = co_await w->pool->Run(copy_out);
      }
      if (!s.ok()) {
        if (w->first_error.ok()) w->first_error = std::move(s);
        co_return;
      }
      (*w->crcs)[i] = crc;
    } else {
      if (scattered) {
        size_t used = 0;  // of the lane's buffer, by the parts only checked
        for (size_t k = p.first_part; k < p.last_part; ++k) {
          const Part& part = (*w->parts)[k];
          char* d = part.dst;
          if (d == nullptr) d = own.get(kPiece) + std::exchange(used, used + part.len);
          spans.push_back({d, part.len});
        }
        iov = spans;
        // The lane's buffer doubles as the scratch of a remote file's one read
        // (the checked-only parts lie in it, each no later than its place).
        s = co_await f->ReadAtV(p.offset, iov, own.get(kPiece));
      } else {
        char* buf = p.dst != nullptr ? p.dst : own.get(kPiece);
        if (p.dst != nullptr && p.len >= kPopulateFrom && !w->populated[i]) {  // PopulateAhead is behind
          w->populated[i] = true;
          auto populate = [buf, len = p.len] { Populate(buf, len); };
          co_await w->pool->Run(populate);
        }
        if (f->ChecksumsWhileReading()) {
          // A remote file: each block checksummed as it arrives, in cache.
          uint32_t crc = 0;
          s = co_await f->ReadAtCrc(p.offset, buf, p.len, &crc);
          (*w->crcs)[i] = crc;
        } else {
          s = co_await f->ReadAt(p.offset, buf, p.len);
          spans.push_back({buf, p.len});
        }
      }
      if (!s.ok()) {
        if (w->first_error.ok()) w->first_error = std::move(s);
        co_return;
      }
      if (!spans.empty()) {  // else taken while reading
        const std::vector<struct iovec>* of = &spans;
        auto crc = [of] {
          uint32_t c = 0;
          for (const struct iovec& v : *of) c = format::Crc32cExtend(c, v.iov_base, v.iov_len);
          return c;
        };
        (*w->crcs)[i] = co_await w->pool->Run(crc);
      }
    }
    w->done += p.len;
    if (w->ckpt->bytes_read != nullptr) w->ckpt->bytes_read->fetch_add(p.len, std::memory_order_relaxed);
    if (w->progress != nullptr && *w->progress) (*w->progress)(w->done, w->total);
  }
}

// Populates the memory of the pieces read into the caller's memory, in the
// order the lanes take them, on the CPU pool, skipping those a lane has taken
// already. One stream runs per pool thread, kWindow at a time so that the
// copies out of the bounce buffers are not queued long behind it. Two
// threads populate fresh memory 2.4-3x faster than one here (8 GiB at 4 KiB
// pages: 1.3-2.4 s against 4.6-6.0 s; the populate floor of
// bench/restore_bench.py measures it), and so run ahead of the disk. A 4 GiB
// restore_into() of fresh torch.empty tensors (bounced: their data sits 64
// bytes past a page), whose pages the copies had faulted in on both threads,
// took 2.15-2.74 s; populated by one stream, 1.72-1.87 s, against 1.61-1.79 s
// into the same tensors touched beforehand.
Task<void> PopulateAhead(PieceWork* w) {
  while (w->first_error.ok()) {
    size_t i = w->next;  // the first piece no lane has taken, nor a stream
    while (i < w->pieces->size() && w->populated[i]) ++i;
    if (i >= w->pieces->size()) break;
    w->populated[i] = true;
    const Piece& p = (*w->pieces)[i];
    if (p.dst == nullptr || p.len < kPopulateFrom || p.last_part > p.first_part) continue;
    const uintptr_t end = reinterpret_cast<uintptr_t>(p.dst) + p.len;
    for (uintptr_t at = reinterpret_cast<uintptr_t>(p.dst); at < end;) {  // windows that end on a page
      const uintptr_t to = end - at > kWindow ? base::RoundDown(at + kWindow, kPage) : end;
      auto populate = [at, to] { Populate(reinterpret_cast<char*>(at), to - at); };
      co_await w->pool->Run(populate);
      at = to;
    }
  }
}

Task<Status> ReadPieces(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const std::vector<Piece>* pieces,
                        std::vector<uint32_t>* crcs, const ProgressFn* progress, const std::vector<Part>* parts = nullptr) {
  uint64_t total = 0;
  for (const Piece& p : *pieces) total += p.len;
  PieceWork work{pool, ckpt, pieces, parts, crcs, progress, total, 0, 0, std::vector<bool>(pieces->size()), Status::Ok()};
  crcs->assign(pieces->size(), 0);
  std::vector<Task<void>> lanes;
  for (size_t i = 0; i < kLanes; ++i) lanes.push_back(PieceLane(&work));
  for (size_t i = 0; i < pool->size(); ++i) lanes.push_back(PopulateAhead(&work));
  co_await WhenAll(std::move(lanes));
  co_return std::move(work.first_error);
}

void AddPieces(std::vector<Piece>* out, size_t shard, uint64_t offset, uint64_t len, char* dst, int64_t tensor) {
  for (uint64_t done = 0; done < len; done += kPiece) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece, len - done));
    out->push_back({shard, offset + done, n, dst ? dst + done : nullptr, tensor});
  }
}

std::string ShardPath(const OpenedCheckpoint& c, size_t shard) {
  const format::ManifestShard& ms = c.manifest.shards[shard];
  if (ms.checkpoint.empty()) return c.path + "/" + ms.name;
  // A file of an earlier checkpoint (an incremental save): named by its own
  // path, and by the step that relies on it.
  return c.path.substr(0, c.path.size() - c.name.size()) + ms.Path() + " (used by " + c.name + ")";
}

Status CrcMismatch(const OpenedCheckpoint& c, const format::ManifestTensor& t, uint32_t got) {
  return CorruptionError(ShardPath(c, t.shard) + ": tensor \"" + t.name + "\" (offset " + std::to_string(t.offset) +
                         ", " + std::to_string(t.bytes) + " bytes): CRC32C mismatch: manifest says " +
                         format::Crc32cToHex(t.crc32c) + ", data has " + format::Crc32cToHex(got));
}

// Folds piece CRCs into per-tensor CRCs (pieces of a tensor are in order).
std::vector<uint32_t> TensorCrcs(const OpenedCheckpoint& c, const std::vector<Piece>& pieces,
                                 const std::vector<uint32_t>& crcs) {
  std::vector<uint32_t> out(c.manifest.tensors.size(), 0);
  std::vector<bool> started(out.size(), false);
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].tensor < 0) continue;
    auto t = static_cast<size_t>(pieces[i].tensor);
    out[t] = started[t] ? format::Crc32cCombine(out[t], crcs[i], pieces[i].len) : crcs[i];
    started[t] = true;
  }
  return out;
}

Task<Status> OpenShard(storage::Storage* storage, OpenedCheckpoint* c, size_t i, bool subset = false) {
  const format::ManifestShard& ms = c->manifest.shards[i];
  const std::string path = ShardPath(*c, i);
  auto opened = co_await storage->OpenFile(ms.checkpoint.empty() ? c->name : ms.checkpoint, ms.name);
  if (opened.status().code() == StatusCode::kNotFound) {
    // The manifest lists it: a missing shard is damage, not a bad request.
    co_return CorruptionError(path + ": missing, but the manifest " +
                              (ms.checkpoint.empty() ? std::string("lists it") : "of " + c->name + " refers to it") +
                              " (" + opened.status().message() + ")");
  }
  CO_ASSIGN_OR_RETURN(c->shards[i], std::move(opened));
  storage::ReadableFile* f = c->shards[i].get();
  if (f->size() != ms.bytes) {
    co_return CorruptionError(path + ": " + std::to_string(f->size()) + " bytes, but the manifest says " +
                              std::to_string(ms.bytes) + (f->size() < ms.bytes ? " (truncated)" : ""));
  }
  uint8_t first8[8];
  CO_TRY(co_await f->ReadAt(0, reinterpret_cast<char*>(first8), 8));
  CO_ASSIGN_OR_RETURN(uint64_t n, format::ParseHeaderLength(path, first8, f->size()));
  std::string json(n, '\0');
  CO_TRY(co_await f->ReadAt(8, json.data(), n));
  auto bytes = std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(json.data()), json.size());
  CO_ASSIGN_OR_RETURN(format::SafetensorsHeader header, format::ParseSafetensorsHeader(path, bytes, f->size()));
  co_return format::CheckShardMatchesManifest(c->manifest, i, header, f->size(), subset);
}

}  // namespace

Task<Result<OpenedCheckpoint>> OpenCheckpoint(storage::Storage* storage, std::string name, ShardFilter filter) {
  OpenedCheckpoint c;
  c.name = name;
  c.path = storage->root() + "/" + name;
  CO_ASSIGN_OR_RETURN(std::string bytes,
                      co_await storage->ReadSmallFile(name, "manifest.json", format::kMaxManifestBytes));
  CO_ASSIGN_OR_RETURN(c.manifest, format::ParseManifest(c.path + "/manifest.json", bytes));
  c.shards.resize(c.manifest.shards.size());
  const std::vector<bool> wanted = filter ? filter(c.manifest) : std::vector<bool>(c.shards.size(), true);
  std::vector<Task<Status>> opens;
  for (size_t i = 0; i < c.shards.size(); ++i) {
    if (i < wanted.size() && wanted[i]) opens.push_back(OpenShard(storage, &c, i));
  }
  std::vector<Status> opened = co_await WhenAll(std::move(opens));
  for (Status& s : opened) CO_TRY(s);
  co_return std::move(c);
}

Task<Status> OpenShards(OpenedCheckpoint* c, std::vector<storage::Storage*> sources, bool subset) {
  c->shards.resize(c->manifest.shards.size());
  std::vector<Task<Status>> opens;
  for (size_t i = 0; i < c->shards.size() && i < sources.size(); ++i) {
    if (sources[i] != nullptr) opens.push_back(OpenShard(sources[i], c, i, subset));
  }
  std::vector<Status> opened = co_await WhenAll(std::move(opens));
  for (Status& s : opened) CO_TRY(s);
  co_return Status::Ok();
}

Task<Status> ReadTensors(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, std::vector<size_t> tensors,
                         std::vector<char*> dsts, const ProgressFn* progress) {
  std::vector<RangeRead> reads;
  for (size_t k = 0; k < tensors.size(); ++k) {
    reads.push_back({tensors[k], 0, ckpt->manifest.tensors[tensors[k]].bytes, dsts[k]});
  }
  co_return co_await ReadRanges(pool, ckpt, reads, progress);
}

namespace {

// One run of a tensor's bytes to read: `len` bytes at `offset` of its data
// into dst (null: only checked).
struct Run {
  uint64_t offset;
  uint64_t len;
  char* dst;
};

// The runs that read bytes [from, to) of tensor `t` once, in order, for the
// rows of `reads` (its reads) that fall there (cut at the window's ends);
// rows that overlap bytes an earlier row reads go to `copies`, to be copied
// from the runs once read.
std::vector<Run> CoverWindow(const std::vector<RangeRead>& reads, const std::vector<size_t>& of_tensor, uint64_t from,
                             uint64_t to, std::vector<Run>* copies) {
  std::vector<Run> rows;
  for (size_t k : of_tensor) {
    const RangeRead& r = reads[k];
    if (r.len == 0 || r.rows == 0 || to <= r.offset) continue;
    const uint64_t stride = r.rows > 1 ? r.stride : 0;
    uint64_t lo = 0, hi = r.rows;
    if (stride > 0) {
      lo = from > r.offset ? (from - r.offset) / stride : 0;
      hi = std::min<uint64_t>(r.rows, (to - r.offset - 1) / stride + 1);
    }
    for (uint64_t i = lo; i < hi; ++i) {
      const uint64_t start = r.offset + i * stride;
      const uint64_t a = std::max(start, from), b = std::min(start + r.len, to);
      if (a < b) rows.push_back({a, b - a, r.dst + i * r.dst_stride + (a - start)});
    }
  }
  // By offset, the longer first where two start together.
  std::sort(rows.begin(), rows.end(), [](const Run& a, const Run& b) {
    return a.offset != b.offset ? a.offset < b.offset : a.len > b.len;
  });
  std::vector<Run> runs;
  uint64_t covered = from;  // bytes [from, covered) have their run
  for (const Run& row : rows) {
    const uint64_t end = row.offset + row.len;
    if (end <= covered) {  // inside what is read already (a replica's copy, say)
      copies->push_back(row);
      continue;
    }
    if (row.offset > covered) runs.push_back({covered, row.offset - covered, nullptr});
    if (row.offset < covered) copies->push_back({row.offset, covered - row.offset, row.dst});
    const uint64_t start = std::max(row.offset, covered);
    runs.push_back({start, end - start, row.dst + (start - row.offset)});
    covered = end;
  }
  if (covered < to) runs.push_back({covered, to - covered, nullptr});
  return runs;
}

// Rows of one group of windows read together: the bookkeeping of a read made
// of many short rows (about 64 bytes a row: a 1 GiB restore onto column
// strips of 512 bytes held ~100 MiB of it) stays this many rows' worth, at
// the cost of the lanes draining once per group. A read of whole tensors or
// long rows is one group.
constexpr uint64_t kGroupRows = uint64_t{1} << 16;

// At most this many buffers in one vectored read (IOV_MAX).
constexpr size_t kMaxParts = 1024;

// Cuts a tensor's runs into pieces of at most kPiece bytes and kMaxParts
// runs: one run, a plain read; several, a scattered one (`parts`). A piece
// of a file read through the bounce buffers (`bounced`) that reaches
// kBounceFrom bytes takes any number of runs: they are copied out, not read
// into (rows of 512 bytes made pieces of 512 KiB, and their per-piece costs
// made a restore onto column strips slower than reading whole chunks).
void AddRuns(std::vector<Piece>* pieces, std::vector<Part>* parts, const format::ManifestTensor& t,
             const std::vector<Run>& runs, bool bounced) {
  size_t r = 0;
  uint64_t used = 0;  // of runs[r]
  while (r < runs.size()) {
    const uint64_t start = runs[r].offset + used;
    const size_t first = parts->size();
    uint64_t len = 0;
    while (r < runs.size() && len < kPiece && (parts->size() - first < kMaxParts || (bounced && len >= kBounceFrom))) {
      const uint64_t n = std::min<uint64_t>(runs[r].len - used, kPiece - len);
      parts->push_back({n, runs[r].dst ? runs[r].dst + used : nullptr});
      len += n;
      used += n;
      if (used == runs[r].len) ++r, used = 0;
    }
    if (parts->size() - first == 1) {  // a plain read
      pieces->push_back({t.shard, t.offset + start, static_cast<size_t>(len), parts->back().dst, -1});
      parts->pop_back();
    } else {
      pieces->push_back({t.shard, t.offset + start, static_cast<size_t>(len), nullptr, -1, first, parts->size()});
    }
  }
}

// Copies row `c` from the runs (sorted by offset) that read its bytes.
void CopyFromRuns(const std::vector<Run>& runs, const Run& c) {
  auto it = std::upper_bound(runs.begin(), runs.end(), c.offset,
                             [](uint64_t off, const Run& r) { return off < r.offset; });
  for (--it; it != runs.end() && it->offset < c.offset + c.len; ++it) {
    const uint64_t from = std::max(c.offset, it->offset);
    const uint64_t to = std::min(c.offset + c.len, it->offset + it->len);
    if (from < to && it->dst != nullptr) std::memcpy(c.dst + (from - c.offset), it->dst + (from - it->offset), to - from);
  }
}

}  // namespace

Task<Status> ReadRanges(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const std::vector<RangeRead>& reads,
                        const ProgressFn* progress) {
  std::map<size_t, std::vector<size_t>> by_tensor;  // tensor -> its reads
  for (size_t k = 0; k < reads.size(); ++k) {
    const RangeRead& r = reads[k];
    const uint64_t t_bytes = ckpt->manifest.tensors[r.tensor].bytes;
    if ((r.len > 0 && r.rows > 0) || t_bytes == 0) by_tensor[r.tensor].push_back(k);  // no bytes asked: no check
  }
  // Each tensor's CRC32C covers all of its bytes: a tensor read only in part
  // has the rest read too (into the lanes' buffers, in the same parallel
  // reads) so that every byte handed out is checked. The ranges a restore
  // asks for usually cover their chunks together (a process's devices hold
  // all of a chunk), and then nothing more is read.
  //
  // The tensors are read in windows (bytes [from, to) of one tensor), in
  // groups of about kGroupRows rows: a tensor of more rows than that is cut
  // into windows of about that many, each group read in parallel in turn.
  struct Window {
    size_t tensor;
    uint64_t from, to;
    const std::vector<size_t>* of_tensor;
  };
  std::vector<std::vector<Window>> groups(1);
  uint64_t group_rows = 0;
  for (const auto& [tensor, of_tensor] : by_tensor) {
    const uint64_t t_bytes = ckpt->manifest.tensors[tensor].bytes;
    uint64_t rows = 0;
    for (size_t k : of_tensor) rows += reads[k].rows;
    const uint64_t windows = std::max<uint64_t>(1, rows / kGroupRows);
    const uint64_t step = base::RoundUp(std::max<uint64_t>(1, (t_bytes + windows - 1) / windows), kPage);
    for (uint64_t from = 0;;) {
      const uint64_t to = std::min(t_bytes, from + step);
      const uint64_t cost = windows == 1 ? rows : kGroupRows;
      if (group_rows > 0 && group_rows + cost > kGroupRows) {
        groups.emplace_back();
        group_rows = 0;
      }
      groups.back().push_back({tensor, from, to, &of_tensor});
      group_rows += cost;
      from = to;
      if (from >= t_bytes) break;
    }
  }
  struct Check {
    size_t first_piece, last_piece;
    std::vector<Run> runs, copies;
  };
  // Progress over the whole read, not per group: each group's ReadPieces
  // counts its own bytes.
  uint64_t total = 0, before = 0;  // bytes of every group; of the groups read
  for (const auto& [tensor, of_tensor] : by_tensor) total += ckpt->manifest.tensors[tensor].bytes;
  ProgressFn overall;
  if (progress != nullptr && *progress) {
    overall = [&](uint64_t done, uint64_t) { (*progress)(before + done, total); };
  }
  std::map<size_t, uint32_t> crc_of;  // tensor -> the CRC32C of its windows read so far
  for (const std::vector<Window>& group : groups) {
    std::vector<Check> checks;
    std::vector<Piece> pieces;
    std::vector<Part> parts;
    for (const Window& w : group) {
      const format::ManifestTensor& t = ckpt->manifest.tensors[w.tensor];
      Check c{pieces.size(), 0, {}, {}};
      c.runs = CoverWindow(reads, *w.of_tensor, w.from, w.to, &c.copies);
      AddRuns(&pieces, &parts, t, c.runs, ckpt->shards[t.shard]->PrefersBounce());
      c.last_piece = pieces.size();
      checks.push_back(std::move(c));
    }
    std::vector<uint32_t> crcs;
    CO_TRY(co_await ReadPieces(pool, ckpt, &pieces, &crcs, overall ? &overall : nullptr, &parts));
    for (const Piece& p : pieces) before += p.len;
    for (size_t g = 0; g < group.size(); ++g) {
      const Window& w = group[g];
      const format::ManifestTensor& t = ckpt->manifest.tensors[w.tensor];
      uint32_t& crc = crc_of[w.tensor];
      for (size_t i = checks[g].first_piece; i < checks[g].last_piece; ++i) {
        crc = pieces[i].offset == t.offset ? crcs[i] : format::Crc32cCombine(crc, crcs[i], pieces[i].len);
      }
      if (w.to == t.bytes && crc != t.crc32c) co_return CrcMismatch(*ckpt, t, crc);
    }
    for (const Check& check : checks) {
      for (const Run& c : check.copies) CopyFromRuns(check.runs, c);
    }
  }
  co_return Status::Ok();
}

Task<Status> ReadTensorPieces(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const std::vector<TensorPieceRead>* reads,
                              std::vector<uint32_t>* crcs) {
  std::vector<Piece> pieces;
  pieces.reserve(reads->size());
  for (const TensorPieceRead& r : *reads) {
    const format::ManifestTensor& t = ckpt->manifest.tensors[r.tensor];
    pieces.push_back({t.shard, t.offset + r.offset, r.len, r.dst, static_cast<int64_t>(r.tensor)});
  }
  co_return co_await ReadPieces(pool, ckpt, &pieces, crcs, nullptr);
}

Status TensorCrcMismatch(const OpenedCheckpoint& ckpt, size_t tensor, uint32_t got) {
  return CrcMismatch(ckpt, ckpt.manifest.tensors[tensor], got);
}

Task<Result<uint64_t>> VerifyAll(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const ProgressFn* progress) {
  const format::Manifest& m = ckpt->manifest;
  // Tensors of each shard in offset order, so pieces cover each file in order.
  std::vector<std::vector<size_t>> by_shard(m.shards.size());
  for (size_t i = 0; i < m.tensors.size(); ++i) by_shard[m.tensors[i].shard].push_back(i);
  std::vector<Piece> pieces;
  uint64_t total = 0;
  for (size_t s = 0; s < m.shards.size(); ++s) {
    auto& ts = by_shard[s];
    std::sort(ts.begin(), ts.end(), [&](size_t a, size_t b) { return m.tensors[a].offset < m.tensors[b].offset; });
    uint64_t pos = 0;
    for (size_t t : ts) {
      AddPieces(&pieces, s, pos, m.tensors[t].offset - pos, nullptr, -1);
      AddPieces(&pieces, s, m.tensors[t].offset, m.tensors[t].bytes, nullptr, static_cast<int64_t>(t));
      pos = m.tensors[t].offset + m.tensors[t].bytes;
    }
    AddPieces(&pieces, s, pos, m.shards[s].bytes - pos, nullptr, -1);
    total += m.shards[s].bytes;
  }
  std::vector<uint32_t> crcs;
  CO_TRY(co_await ReadPieces(pool, ckpt, &pieces, &crcs, progress));
  std::vector<uint32_t> tensor_crc = TensorCrcs(*ckpt, pieces, crcs);
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    if (tensor_crc[i] != m.tensors[i].crc32c) co_return CrcMismatch(*ckpt, m.tensors[i], tensor_crc[i]);
  }
  std::vector<uint32_t> shard_crc(m.shards.size(), 0);
  std::vector<bool> started(m.shards.size(), false);
  for (size_t i = 0; i < pieces.size(); ++i) {
    size_t s = pieces[i].shard;
    shard_crc[s] = started[s] ? format::Crc32cCombine(shard_crc[s], crcs[i], pieces[i].len) : crcs[i];
    started[s] = true;
  }
  for (size_t s = 0; s < m.shards.size(); ++s) {
    if (shard_crc[s] != m.shards[s].crc32c) {
      co_return CorruptionError(ShardPath(*ckpt, s) + ": CRC32C of the whole file mismatch: manifest says " +
                                format::Crc32cToHex(m.shards[s].crc32c) + ", file has " +
                                format::Crc32cToHex(shard_crc[s]) + " (the header bytes differ)");
    }
  }
  co_return total;
}

}  // namespace ckptio::pipeline

