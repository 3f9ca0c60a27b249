#include "storage/direct_plan.h"

#include <algorithm>
#include <cstring>

#include "base/align.h"

namespace ckptio::storage {
namespace {

using base::RoundUp;

}  // namespace

DirectPlan::DirectPlan(const FileImage* image, size_t max_len, size_t mem_align)
    : image_(image), max_len_(max_len), mem_align_(mem_align), end_(RoundUp(image->size, kDirectBlock)) {}

size_t DirectPlan::SegmentAt(uint64_t pos, size_t from) const {
  const auto& segs = image_->segments;
  size_t i = from;
  while (i + 1 < segs.size() && segs[i].offset + segs[i].len <= pos) ++i;
  return i;
}

uint64_t DirectPlan::DirectEnd(size_t i) const {
  const Segment& s = image_->segments[i];
  const uint64_t end = s.offset + s.len;
  // The block holding the segment's last bytes also holds the next segment's
  // first ones, unless this is the end of the file: then the segment's
  // capacity may cover the padding.
  if (end == image_->size && RoundUp(end, kDirectBlock) - s.offset <= s.capacity) {
    return RoundUp(end, kDirectBlock);
  }
  return end / kDirectBlock * kDirectBlock;
}

bool DirectPlan::DirectAt(uint64_t pos, size_t i) const {
  if (i >= image_->segments.size()) return false;
  const Segment& s = image_->segments[i];
  if (pos < s.offset) return false;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(s.data) + (pos - s.offset);
  return addr % mem_align_ == 0 && pos + kDirectBlock <= DirectEnd(i);
}

DirectWrite DirectPlan::Next(bool direct) {
  DirectWrite w;
  w.offset = pos_;
  const uint64_t limit = std::min<uint64_t>(pos_ + max_len_, end_);
  seg_ = SegmentAt(pos_, seg_);
  if (!direct) {
    w.len = static_cast<size_t>(limit - pos_);
  } else if (DirectAt(pos_, seg_)) {
    const Segment& s = image_->segments[seg_];
    w.data = s.data + (pos_ - s.offset);
    w.len = static_cast<size_t>(std::min(limit, DirectEnd(seg_)) - pos_);
  } else {
    // Gather blocks up to the first one a segment can write directly.
    uint64_t q = pos_ + kDirectBlock;
    size_t i = seg_;
    while (q < limit) {
      i = SegmentAt(q, i);
      if (DirectAt(q, i)) break;
      q += kDirectBlock;
    }
    w.len = static_cast<size_t>(q - pos_);
  }
  pos_ += w.len;
  return w;
}

void DirectPlan::Gather(const DirectWrite& w, char* dst) const {
  const auto& segs = image_->segments;
  const uint64_t end = w.offset + w.len;
  const uint64_t data_end = std::min<uint64_t>(end, image_->size);
  // The first segment that ends after w.offset.
  auto it = std::upper_bound(segs.begin(), segs.end(), w.offset,
                             [](uint64_t off, const Segment& s) { return off < s.offset + s.len; });
  uint64_t pos = w.offset;
  for (; it != segs.end() && pos < data_end; ++it) {
    const uint64_t from = std::max(pos, it->offset);
    const uint64_t to = std::min(data_end, it->offset + it->len);
    if (to <= from) continue;
    std::memcpy(dst + (from - w.offset), it->data + (from - it->offset), to - from);
    pos = to;
  }
  if (data_end < end) std::memset(dst + (data_end - w.offset), 0, end - data_end);
}

}  // namespace ckptio::storage
