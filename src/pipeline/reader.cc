#include "pipeline/reader.h"

#include <algorithm>
#include <map>
#include <memory>

#include "base/status_macros.h"
#include "runtime/when_all.h"
#include "format/crc32c.h"

namespace ckptio::pipeline {
namespace {

constexpr size_t kPiece = size_t{16} << 20;
constexpr size_t kLanes = 8;

// A range of one shard file to read and checksum. tensor < 0: not part of a
// tensor (the header). dst null: read into the lane's own buffer.
struct Piece {
  size_t shard;
  uint64_t offset;
  size_t len;
  char* dst;
  int64_t tensor;
};

struct PieceWork {
  runtime::CpuPool* pool;
  OpenedCheckpoint* ckpt;
  const std::vector<Piece>* pieces;
  std::vector<uint32_t>* crcs;
  const ProgressFn* progress;
  uint64_t total;
  uint64_t done = 0;
  size_t next = 0;
  Status first_error;
};

Task<void> PieceLane(PieceWork* w) {
  std::unique_ptr<char[]> own;
  while (w->next < w->pieces->size() && w->first_error.ok()) {
    size_t i = w->next++;
    const Piece& p = (*w->pieces)[i];
    char* buf = p.dst;
    if (buf == nullptr) {
      if (!own) own.reset(new char[kPiece]);
      buf = own.get();
    }
    Status s = co_await w->ckpt->shards[p.shard]->ReadAt(p.offset, buf, p.len);
    if (!s.ok()) {
      if (w->first_error.ok()) w->first_error = std::move(s);
      co_return;
    }
    size_t len = p.len;
    auto crc = [buf, len] { return format::Crc32c(buf, len); };
    (*w->crcs)[i] = co_await w->pool->Run(crc);
    w->done += len;
    if (w->progress != nullptr && *w->progress) (*w->progress)(w->done, w->total);
  }
}

Task<Status> ReadPieces(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const std::vector<Piece>* pieces,
                        std::vector<uint32_t>* crcs, const ProgressFn* progress) {
  uint64_t total = 0;
  for (const Piece& p : *pieces) total += p.len;
  PieceWork work{pool, ckpt, pieces, crcs, progress, total, 0, 0, Status::Ok()};
  crcs->assign(pieces->size(), 0);
  std::vector<Task<void>> lanes;
  for (size_t i = 0; i < kLanes; ++i) lanes.push_back(PieceLane(&work));
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

Task<Status> OpenShard(storage::Storage* storage, OpenedCheckpoint* c, size_t i) {
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
  co_return format::CheckShardMatchesManifest(c->manifest, i, header, f->size());
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

Task<Status> ReadTensors(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, std::vector<size_t> tensors,
                         std::vector<char*> dsts, const ProgressFn* progress) {
  std::vector<RangeRead> reads;
  for (size_t k = 0; k < tensors.size(); ++k) {
    reads.push_back({tensors[k], 0, ckpt->manifest.tensors[tensors[k]].bytes, dsts[k]});
  }
  co_return co_await ReadRanges(pool, ckpt, reads, progress);
}

namespace {

// One run of a tensor's bytes in the CRC32C check of ReadRanges, in order: the
// pieces [first, last) (of a read, or of a gap no read covers), or bytes of a
// destination already read (where two reads overlap in part).
struct CrcSpan {
  size_t first = 0, last = 0;
  const char* data = nullptr;
  uint64_t len = 0;
};

// The spans that cover tensor `t`'s bytes once, from the reads of it (indices
// into `reads`, `first_piece` their pieces); the gaps between them are added
// to `pieces` as reads into the lanes' own buffers.
std::vector<CrcSpan> CoverTensor(const format::ManifestTensor& t, const std::vector<RangeRead>& reads,
                                 std::vector<size_t> of_tensor, const std::vector<size_t>& first_piece,
                                 std::vector<Piece>* pieces) {
  // By offset, the longer first where two start together: a read that covers
  // the whole tensor comes first and every other read is inside it.
  std::sort(of_tensor.begin(), of_tensor.end(), [&](size_t a, size_t b) {
    return reads[a].offset != reads[b].offset ? reads[a].offset < reads[b].offset : reads[a].len > reads[b].len;
  });
  std::vector<CrcSpan> spans;
  auto gap = [&](uint64_t from, uint64_t to) {
    const size_t first = pieces->size();
    AddPieces(pieces, t.shard, t.offset + from, to - from, nullptr, -1);
    spans.push_back({first, pieces->size()});
  };
  uint64_t covered = 0;  // bytes [0, covered) have their span
  for (size_t k : of_tensor) {
    const RangeRead& r = reads[k];
    const uint64_t end = r.offset + r.len;
    if (end <= covered) continue;  // inside what is covered already (a replica's copy, say)
    if (r.offset > covered) gap(covered, r.offset);
    if (r.offset >= covered) {
      spans.push_back({first_piece[k], first_piece[k + 1]});
    } else {
      spans.push_back({0, 0, r.dst + (covered - r.offset), end - covered});
    }
    covered = end;
  }
  if (covered < t.bytes) gap(covered, t.bytes);
  return spans;
}

}  // namespace

Task<Status> ReadRanges(runtime::CpuPool* pool, OpenedCheckpoint* ckpt, const std::vector<RangeRead>& reads,
                        const ProgressFn* progress) {
  std::vector<Piece> pieces;
  std::vector<size_t> first_piece;  // of each read; its pieces are consecutive
  std::map<size_t, std::vector<size_t>> by_tensor;  // tensor -> its reads
  for (size_t k = 0; k < reads.size(); ++k) {
    const RangeRead& r = reads[k];
    const format::ManifestTensor& t = ckpt->manifest.tensors[r.tensor];
    first_piece.push_back(pieces.size());
    AddPieces(&pieces, t.shard, t.offset + r.offset, r.len, r.dst, -1);
    if (r.len > 0 || t.bytes == 0) by_tensor[r.tensor].push_back(k);  // an empty range of bytes needs no check
  }
  first_piece.push_back(pieces.size());
  // Each tensor's CRC32C covers all of its bytes: a tensor read only in part
  // has the rest read too (into the lanes' buffers, in the same parallel
  // reads) so that every byte handed out is checked. The ranges a restore
  // asks for usually cover their chunks together (a process's devices hold
  // all of a chunk), and then nothing more is read.
  std::vector<std::pair<size_t, std::vector<CrcSpan>>> checks;
  for (auto& [tensor, of_tensor] : by_tensor) {
    checks.push_back({tensor, CoverTensor(ckpt->manifest.tensors[tensor], reads, of_tensor, first_piece, &pieces)});
  }
  std::vector<uint32_t> crcs;
  CO_TRY(co_await ReadPieces(pool, ckpt, &pieces, &crcs, progress));
  for (const auto& check : checks) {
    const format::ManifestTensor& t = ckpt->manifest.tensors[check.first];
    uint32_t crc = 0;
    bool started = false;
    auto fold = [&](uint32_t c, uint64_t len) {
      crc = started ? format::Crc32cCombine(crc, c, len) : c;
      started = true;
    };
    for (const CrcSpan& s : check.second) {
      if (s.data != nullptr) {
        const char* data = s.data;
        const uint64_t len = s.len;
        const uint32_t c = co_await pool->Run([data, len] { return format::Crc32c(data, len); });
        fold(c, len);
      }
      for (size_t i = s.first; i < s.last; ++i) fold(crcs[i], pieces[i].len);
    }
    if (crc != t.crc32c) co_return CrcMismatch(*ckpt, t, crc);
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

