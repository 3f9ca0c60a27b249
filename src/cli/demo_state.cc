#include "cli/demo_state.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <set>
#include <utility>

#include "base/align.h"
#include "base/dtype.h"

namespace ckptio::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kAlign = 4096;
constexpr int kLayers = 19;  // 19 x 5 tensors + 5 others = 100
// Compute touches every kStride-th byte of each tensor per pass.
constexpr uint64_t kStride = 256;

struct Spec {
  std::string name;
  DType dtype;
  double weight;  // share of the state; 0 = a scalar
};

// The tensors of a small transformer-like model. Layer sizes vary so shards
// hold different numbers of tensors; the last tensor takes what rounding
// left over, so the state is exactly the size asked for.
std::vector<Spec> Specs() {
  std::vector<Spec> s;
  s.push_back({"embed/tokens", DType::kBF16, 6});
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "layers/" + std::to_string(l) + "/";
    const double scale = 1.0 + 0.25 * (l % 4);
    s.push_back({p + "attn/qkv/kernel", DType::kBF16, 3 * scale});
    s.push_back({p + "attn/out/kernel", DType::kBF16, 1 * scale});
    s.push_back({p + "mlp/kernel", DType::kF32, 4 * scale});
    s.push_back({p + "mlp/bias", DType::kF16, 0.01});
    s.push_back({p + "norm/scale", DType::kF32, 0.002});
  }
  s.push_back({"final_norm/scale", DType::kF32, 0.002});
  s.push_back({"head/kernel", DType::kF16, 4});
  s.push_back({"opt/count", DType::kI32, 0});
  s.push_back({"data/mask", DType::kU8, 0});  // the remainder
  return s;
}

using base::RoundUp;

// A shape of about `target` bytes of `dtype`: [rows, 1024] when large enough.
// Rounded down to whole 4 KiB blocks where the target allows, as a real
// model's dimensions (multiples of 128 and more) make its tensors: then each
// tensor starts block-aligned in its shard too, so a save that borrows the
// state can write it from the trainer's buffers with O_DIRECT.
std::vector<uint64_t> ShapeFor(DType dtype, uint64_t target) {
  const uint64_t blocks = target / kAlign * kAlign;
  const uint64_t elems = (blocks > 0 ? blocks : target) / base::DTypeSize(dtype);
  if (elems >= 1024) return {elems / 1024, 1024};
  return {elems};
}

// Deterministic, cheap to generate, not constant (so CRCs are not trivial).
void Fill(std::byte* p, uint64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  uint64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const uint64_t v = x + i * 0xBF58476D1CE4E5B9ull;
    std::memcpy(p + i, &v, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<std::byte>(x >> (i % 8 * 8));
}

}  // namespace

Result<DemoState> DemoState::Create(uint64_t bytes, int sets) {
  if (bytes < kAlign) return InvalidArgumentError("--state-size must be at least 4KiB, got " + std::to_string(bytes));
  if (sets != 1 && sets != 2) {
    return InvalidArgumentError("a demo state has 1 or 2 buffer sets, got " + std::to_string(sets));
  }
  DemoState s;
  s.bytes_ = bytes;
  const std::vector<Spec> specs = Specs();
  double total_weight = 0;
  for (const Spec& sp : specs) total_weight += sp.weight;
  const uint64_t budget = bytes - 4;  // opt/count is a 4-byte scalar
  uint64_t used = 0;
  std::vector<std::pair<std::vector<uint64_t>, uint64_t>> layout;  // shape, bytes
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& sp = specs[i];
    std::vector<uint64_t> shape;
    if (i + 1 == specs.size()) {
      shape = {bytes - used};
    } else if (sp.weight > 0) {
      shape = ShapeFor(sp.dtype, static_cast<uint64_t>(static_cast<double>(budget) * sp.weight / total_weight));
    }
    const uint64_t n = base::TensorBytes(sp.dtype, shape).value();
    used += n;
    layout.emplace_back(std::move(shape), n);
  }
  uint64_t offset = 0;
  std::vector<uint64_t> offsets;
  for (const auto& l : layout) {
    offsets.push_back(offset);
    offset += RoundUp(std::max<uint64_t>(l.second, 1), kAlign);
  }
  // Set k lives at base + k * offset: every tensor stays 4 KiB-aligned.
  const uint64_t set_stride = offset;
  void* p = ::mmap(nullptr, set_stride * sets, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    return ErrnoToStatus(errno, "cannot allocate the demo state of " + std::to_string(sets) + " x " +
                                    std::to_string(bytes) + " bytes");
  }
  // Huge pages where the system gives them on request (THP "madvise"), as
  // an allocator of large tensors would ask for: fewer TLB misses for the
  // compute, and a save that borrows the state pins 512x fewer pages for
  // its O_DIRECT writes. Only a hint: 4 KiB pages work too.
  (void)::madvise(p, set_stride * sets, MADV_HUGEPAGE);
  s.base_ = static_cast<std::byte*>(p);
  s.mapped_ = set_stride * sets;
  s.sets_.resize(sets);
  for (size_t i = 0; i < specs.size(); ++i) {
    for (int k = 0; k < sets; ++k) {
      std::byte* data = s.base_ + k * set_stride + offsets[i];
      Fill(data, layout[i].second, i);
      s.sets_[k].push_back({specs[i].name, specs[i].dtype, layout[i].first, data});
    }
    s.sizes_.push_back(layout[i].second);
  }
  return s;
}

DemoState::DemoState(DemoState&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)),
      mapped_(std::exchange(other.mapped_, 0)),
      bytes_(other.bytes_),
      sets_(std::move(other.sets_)),
      current_(other.current_),
      sizes_(std::move(other.sizes_)),
      phase_(other.phase_) {}

DemoState::~DemoState() {
  if (base_ != nullptr) ::munmap(base_, mapped_);
}

std::byte* DemoState::MutableData(int set, size_t i) const {
  // The tensors point into our own writable mapping.
  return const_cast<std::byte*>(static_cast<const std::byte*>(sets_[set][i].data));
}

std::string DemoState::DTypeSummary() const {
  std::string out;
  std::set<DType> seen;
  for (const TensorRef& t : tensors()) {
    if (!seen.insert(t.dtype).second) continue;
    out += (out.empty() ? "" : ", ") + std::string(base::DTypeName(t.dtype));
  }
  return out;
}

void DemoState::WriteNextState(int from, int to) {
  for (size_t i = 0; i < sizes_.size(); ++i) {
    const std::byte* in = MutableData(from, i);
    std::byte* out = MutableData(to, i);
    uint64_t j = 0;
    for (; j + 8 <= sizes_[i]; j += 8) {
      uint64_t v;
      std::memcpy(&v, in + j, 8);
      v += 1;
      std::memcpy(out + j, &v, 8);
    }
    for (; j < sizes_[i]; ++j) out[j] = static_cast<std::byte>(static_cast<uint8_t>(in[j]) + 1);
  }
}

void DemoState::Compute(std::chrono::nanoseconds duration) {
  const Clock::time_point deadline = Clock::now() + duration;
  if (sets_.size() > 1) {
    const int next = NextSet();
    WriteNextState(current_, next);
    current_ = next;
  }
  while (Clock::now() < deadline) {
    const uint64_t start = phase_ % kStride;
    for (size_t i = 0; i < sizes_.size() && Clock::now() < deadline; ++i) {
      auto* p = reinterpret_cast<uint8_t*>(MutableData(current_, i));
      for (uint64_t j = start; j < sizes_[i]; j += kStride) p[j] = static_cast<uint8_t>(p[j] + 1);
    }
    phase_ += 61;  // coprime with kStride: every byte gets its turn
  }
}

}  // namespace ckptio::cli
