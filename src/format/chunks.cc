// The checks on chunked arrays (format_version 2): each chunk is a box inside
// its array's global shape, and the chunks of one array tile it exactly.
#include <algorithm>
#include <map>
#include <unordered_set>

#include "base/status_macros.h"
#include "format/manifest.h"
#include "format/validate.h"

namespace ckptio::format {
namespace {

// Axes shown in a box, as base::ShapeToString shows dimensions: a message
// about a hostile chunk of hundreds of axes stays short (under 2 KiB).
constexpr size_t kMaxShownAxes = 16;

// The decimal digits of v: a hostile chunk's end, start + extent, may not fit
// in 64 bits.
std::string Decimal(unsigned __int128 v) {
  std::string digits;
  do {
    digits.insert(digits.begin(), static_cast<char>('0' + static_cast<int>(v % 10)));
    v /= 10;
  } while (v != 0);
  return digits;
}

// "[16:32, 0:8]": a chunk's box in its array, for messages.
std::string BoxText(const ManifestTensor& t) {
  std::string text = "[";
  for (size_t a = 0; a < t.shape.size(); ++a) {
    if (a > 0) text += ", ";
    if (a == kMaxShownAxes) {
      text += "... (" + std::to_string(t.shape.size()) + " dims)";
      break;
    }
    const uint64_t start = t.chunk.start[a];
    text += std::to_string(start) + ":" + Decimal(static_cast<unsigned __int128>(start) + t.shape[a]);
  }
  return text + "]";
}

// Elements in a shape whose bytes TensorBytes accepted (so the product of the
// non-zero dimensions fits; a zero dimension makes it zero).
uint64_t Elements(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (d == 0) return 0;
  }
  for (uint64_t d : shape) n *= d;
  return n;
}

Status CheckOneChunk(std::string_view file, const ManifestTensor& t) {
  const std::string context = std::string(file) + ": tensor " + Quoted(t.name);
  const ChunkOf& c = t.chunk;
  if (Status st = CheckTensorName(c.array); !st.ok()) return AsCorruption(context + ": array", st);
  if (c.global_shape.size() != t.shape.size() || c.start.size() != t.shape.size()) {
    return CorruptionError(context + ": a chunk's shape, global_shape and start need one entry per axis; they have " +
                           std::to_string(t.shape.size()) + ", " + std::to_string(c.global_shape.size()) + " and " +
                           std::to_string(c.start.size()));
  }
  for (size_t a = 0; a < t.shape.size(); ++a) {
    // Two comparisons, so that start + extent cannot overflow.
    if (c.start[a] > c.global_shape[a] || t.shape[a] > c.global_shape[a] - c.start[a]) {
      return CorruptionError(context + ": chunk " + BoxText(t) + " runs past axis " + std::to_string(a) +
                             " of array " + Quoted(c.array) + ", whose global shape is " +
                             base::ShapeToString(c.global_shape));
    }
  }
  if (auto bytes = base::TensorBytes(t.dtype, c.global_shape); !bytes.ok()) {
    return AsCorruption(context + ": global_shape of array " + Quoted(c.array), bytes.status());
  }
  if (const std::string want = ChunkName(c.array, c.start); t.name != want) {
    return CorruptionError(context + ": the chunk of array " + Quoted(c.array) + " at " +
                           base::ShapeToString(c.start) + " must be named " + Quoted(want));
  }
  return Status::Ok();
}

bool Overlap(const ManifestTensor& x, const ManifestTensor& y) {
  for (size_t a = 0; a < x.shape.size(); ++a) {
    const uint64_t xs = x.chunk.start[a], ys = y.chunk.start[a];
    if (xs + x.shape[a] <= ys || ys + y.shape[a] <= xs) return false;
  }
  return true;
}

// No two non-empty chunks of one array overlap. A sweep along the axis with
// the most distinct starts: each chunk is compared only with those still open
// on that axis (a grid of n x m chunks costs n*m*m comparisons, not (n*m)^2).
Status CheckNoOverlap(std::string_view file, const std::string& array, std::vector<const ManifestTensor*> chunks) {
  std::erase_if(chunks, [](const ManifestTensor* t) { return Elements(t->shape) == 0; });
  const size_t rank = chunks.empty() ? 0 : chunks[0]->shape.size();
  size_t axis = 0, most = 0;
  for (size_t a = 0; a < rank; ++a) {
    std::unordered_set<uint64_t> starts;
    for (const ManifestTensor* t : chunks) starts.insert(t->chunk.start[a]);
    if (starts.size() > most) most = starts.size(), axis = a;
  }
  auto start = [&](const ManifestTensor* t) { return rank ? t->chunk.start[axis] : 0; };
  auto end = [&](const ManifestTensor* t) { return rank ? t->chunk.start[axis] + t->shape[axis] : 1; };
  std::sort(chunks.begin(), chunks.end(),
            [&](const ManifestTensor* x, const ManifestTensor* y) { return start(x) < start(y); });
  std::vector<const ManifestTensor*> open;
  for (const ManifestTensor* t : chunks) {
    std::erase_if(open, [&](const ManifestTensor* o) { return end(o) <= start(t); });
    for (const ManifestTensor* o : open) {
      if (Overlap(*o, *t)) {
        return CorruptionError(std::string(file) + ": chunks " + Quoted(o->name) + " " + BoxText(*o) + " and " +
                               Quoted(t->name) + " " + BoxText(*t) + " of array " + Quoted(array) + " overlap");
      }
    }
    open.push_back(t);
  }
  return Status::Ok();
}

}  // namespace

int FormatVersionFor(const std::vector<ManifestTensor>& tensors) {
  for (const ManifestTensor& t : tensors) {
    if (!t.chunk.empty()) return kChunkedFormatVersion;
  }
  return kManifestFormatVersion;
}

int FormatVersionFor(const Manifest& manifest) {
  for (const ManifestShard& s : manifest.shards) {
    if (!s.checkpoint.empty()) return kIncrementalFormatVersion;
  }
  for (const ManifestTensor& t : manifest.tensors) {
    if (t.xxh3) return kIncrementalFormatVersion;
  }
  return FormatVersionFor(manifest.tensors);
}

Status CheckChunks(std::string_view file, const std::vector<ManifestTensor>& tensors, Chunks completeness) {
  std::map<std::string_view, std::vector<const ManifestTensor*>> arrays;
  std::unordered_set<std::string_view> whole;
  for (const ManifestTensor& t : tensors) {
    if (t.chunk.empty()) {
      whole.insert(t.name);
      continue;
    }
    RETURN_IF_ERROR(CheckOneChunk(file, t));
    std::vector<const ManifestTensor*>& chunks = arrays[t.chunk.array];
    if (!chunks.empty()) {
      const ManifestTensor& first = *chunks.front();
      if (t.dtype != first.dtype || t.chunk.global_shape != first.chunk.global_shape) {
        return CorruptionError(std::string(file) + ": chunks " + Quoted(first.name) + " and " + Quoted(t.name) +
                               " of array " + Quoted(t.chunk.array) + " disagree on its dtype or global shape (" +
                               std::string(base::DTypeName(first.dtype)) + " " +
                               base::ShapeToString(first.chunk.global_shape) + " against " +
                               std::string(base::DTypeName(t.dtype)) + " " +
                               base::ShapeToString(t.chunk.global_shape) + ")");
      }
    }
    chunks.push_back(&t);
  }
  for (const auto& [array, chunks] : arrays) {
    const std::string name(array);
    if (whole.contains(array)) {
      return CorruptionError(std::string(file) + ": " + Quoted(name) +
                             " is both a whole tensor and an array split into chunks");
    }
    RETURN_IF_ERROR(CheckNoOverlap(file, name, chunks));
    if (completeness == Chunks::kPartial) continue;
    // Inside the array and not overlapping: the chunks cover it iff their
    // elements add up to its own.
    const uint64_t want = Elements(chunks[0]->chunk.global_shape);
    unsigned __int128 have = 0;
    for (const ManifestTensor* t : chunks) have += Elements(t->shape);
    if (have != want) {
      return CorruptionError(std::string(file) + ": the chunks of array " + Quoted(name) + " cover " +
                             std::to_string(static_cast<uint64_t>(have)) + " of the " + std::to_string(want) +
                             " elements of its global shape " + base::ShapeToString(chunks[0]->chunk.global_shape) +
                             ": a chunk is missing");
    }
  }
  return Status::Ok();
}

}  // namespace ckptio::format
