// O_DIRECT writes of file images that are not block-aligned in memory
// (borrowed tensors): the DirectPlan on random layouts, and borrow-mode saves
// of odd-sized tensors at odd addresses on the real file system, which must
// be written with O_DIRECT and read back bit-exact.

#include <doctest/doctest.h>
#include <fcntl.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "base/unique_fd.h"
#include "storage/direct_plan.h"
#include "storage/local_internal.h"
#include "storage/local_storage.h"
#include "test_util.h"

namespace ckptio {
namespace {

using storage::DirectPlan;
using storage::DirectWrite;
using storage::FileImage;
using storage::kDirectBlock;
using storage::Segment;

uint64_t RoundUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// A 4 KiB-aligned arena the segments of a test image point into.
struct Arena {
  explicit Arena(size_t n) : bytes(n + 2 * kDirectBlock) {
    base = bytes.data() + (kDirectBlock - reinterpret_cast<uintptr_t>(bytes.data()) % kDirectBlock);
  }
  std::vector<char> bytes;
  char* base;
};

// Plays a plan into a file image in memory, checking every write's
// alignment, bounds and order on the way.
std::string Play(DirectPlan& plan, const FileImage& image, size_t max_len, uint64_t* gathered,
                 size_t mem_align = kDirectBlock, bool direct = true) {
  std::string file(RoundUp(image.size, kDirectBlock), '\xEE');
  std::vector<char> bounce(max_len + kDirectBlock);
  char* buf = bounce.data() + (kDirectBlock - reinterpret_cast<uintptr_t>(bounce.data()) % kDirectBlock);
  uint64_t next = 0;
  while (!plan.done()) {
    DirectWrite w = plan.Next(direct);
    REQUIRE(w.offset == next);
    REQUIRE(w.len > 0);
    REQUIRE(w.len <= max_len);
    REQUIRE(w.offset % kDirectBlock == 0);
    REQUIRE(w.len % kDirectBlock == 0);
    REQUIRE(w.offset + w.len <= RoundUp(image.size, kDirectBlock));
    if (w.data != nullptr) {
      REQUIRE(reinterpret_cast<uintptr_t>(w.data) % mem_align == 0);
      // A direct write reads only memory of the segment that holds its
      // first byte, within that segment's capacity.
      const Segment* seg = nullptr;
      for (const Segment& s : image.segments) {
        if (s.offset <= w.offset && w.offset < s.offset + std::max<size_t>(s.len, 1)) seg = &s;
      }
      REQUIRE(seg != nullptr);
      REQUIRE(w.data == seg->data + (w.offset - seg->offset));
      REQUIRE(w.offset + w.len <= seg->offset + seg->capacity);
      std::memcpy(file.data() + w.offset, w.data, w.len);
    } else {
      plan.Gather(w, buf);
      std::memcpy(file.data() + w.offset, buf, w.len);
      *gathered += w.len;
    }
    next = w.offset + w.len;
  }
  CHECK(next == RoundUp(image.size, kDirectBlock));
  return file;
}

TEST_CASE("a direct plan writes every byte of random layouts once, aligned, from the right memory") {
  std::mt19937_64 rng(20261202);
  for (int round = 0; round < 400; ++round) {
    const int n = 1 + static_cast<int>(rng() % 12);
    const size_t max_len = kDirectBlock * (1 + rng() % 8);
    const size_t mem_align = rng() % 2 == 0 ? kDirectBlock : 512;  // what statx says of the file
    std::vector<size_t> lens;
    size_t total = 0;
    for (int i = 0; i < n; ++i) {
      // Mostly odd sizes, some whole blocks, some empty.
      size_t len = rng() % 5 == 0 ? kDirectBlock * (rng() % 6) : rng() % 30000;
      lens.push_back(len);
      total += len;
    }
    Arena arena(total + n * 2 * kDirectBlock);
    FileImage image;
    image.size = total;
    std::string want;
    size_t mem = 0, offset = 0;
    for (int i = 0; i < n; ++i) {
      // Memory that agrees with the file offset mod the memory alignment half
      // of the time.
      mem = RoundUp(mem, kDirectBlock) + (rng() % 2 == 0 ? offset % mem_align + mem_align * (rng() % (kDirectBlock / mem_align))
                                                          : rng() % kDirectBlock);
      char* p = arena.base + mem;
      for (size_t k = 0; k < lens[i]; ++k) p[k] = static_cast<char>(rng());
      const size_t capacity = lens[i] + (rng() % 2 == 0 ? kDirectBlock : 0);
      image.segments.push_back({offset, p, lens[i], capacity});
      want.append(p, lens[i]);
      offset += lens[i];
      mem += capacity;
    }
    DirectPlan plan(&image, max_len, mem_align);
    uint64_t gathered = 0;
    std::string file = Play(plan, image, max_len, &gathered, mem_align);
    INFO("round " << round);
    REQUIRE(file.substr(0, total) == want);
    CHECK(file.find_first_not_of('\0', total) == std::string::npos);  // padding is zeros
  }
}

TEST_CASE("a direct plan writes aligned runs straight from memory and gathers only around them") {
  Arena arena(4 << 20);
  FileImage image;
  // A 4 KiB header from aligned memory, a 1 MiB + 100 B tensor whose memory
  // agrees with its file offset, then a 3 B tensor and a 70,000 B one at
  // addresses that do not.
  const size_t big = (1 << 20) + 100;
  image.segments.push_back({0, arena.base, 4096, 4096});
  image.segments.push_back({4096, arena.base + 8192, big, big});
  image.segments.push_back({4096 + big, arena.base + (2 << 20) + 1, 3, 3});
  image.segments.push_back({4096 + big + 3, arena.base + (3 << 20) + 7, 70000, 70000});
  image.size = 4096 + big + 3 + 70000;
  for (const Segment& s : image.segments) std::memset(const_cast<char*>(s.data), static_cast<int>(s.len % 251), s.len);
  DirectPlan plan(&image, 1 << 20);
  uint64_t gathered = 0;
  std::string file = Play(plan, image, 1 << 20, &gathered);
  // Only the blocks from the big tensor's tail onwards are gathered.
  CHECK(gathered == RoundUp(image.size, kDirectBlock) - (4096 + (1 << 20)));

  // A layout that is aligned everywhere gathers nothing.
  FileImage aligned;
  aligned.segments.push_back({0, arena.base, 4096, 4096});
  aligned.segments.push_back({4096, arena.base + 8192, 10000, 12288});
  aligned.size = 4096 + 10000;
  DirectPlan plan2(&aligned, 1 << 20);
  uint64_t gathered2 = 0;
  Play(plan2, aligned, 1 << 20, &gathered2);
  CHECK(gathered2 == 0);
}

TEST_CASE("with a 512-byte memory alignment, memory that agrees with the file offset modulo 512 goes out direct") {
  // A safetensors prefix of 4 KiB + 64 B (its data starts 64 B past a block,
  // as PlanShards lays out a tensor at an address 64 B past 512), then a
  // 1 MiB tensor whose address is 576 B past a 4 KiB page: agrees modulo 512,
  // not modulo 4096. Writes start on 4 KiB file boundaries either way.
  Arena arena(4 << 20);
  FileImage image;
  const size_t prefix = 4096 + 64, big = 1 << 20;
  image.segments.push_back({0, arena.base, prefix, prefix});
  image.segments.push_back({prefix, arena.base + (2 << 20) + 576, big, big});
  image.size = prefix + big;
  for (const Segment& s : image.segments) std::memset(const_cast<char*>(s.data), static_cast<int>(s.len % 251), s.len);
  const uint64_t blocks = RoundUp(image.size, kDirectBlock);
  DirectPlan plan(&image, 1 << 20, 512);
  uint64_t gathered = 0;
  std::string file = Play(plan, image, 1 << 20, &gathered, 512);
  // Gathered: the block holding the prefix's tail and the tensor's head, and
  // the tensor's last partial block; the rest straight from memory.
  CHECK(gathered == 2 * kDirectBlock);
  CHECK(file.substr(prefix, big) == std::string(image.segments[1].data, big));

  DirectPlan strict(&image, 1 << 20, kDirectBlock);  // a file system that wants 4 KiB-aligned memory
  uint64_t gathered_strict = 0;
  Play(strict, image, 1 << 20, &gathered_strict, kDirectBlock);
  CHECK(gathered_strict == blocks - kDirectBlock);

  // While the trainer waits (Storage::SetWaitedOn), everything is gathered.
  DirectPlan hurried(&image, 1 << 20, 512);
  uint64_t gathered_hurried = 0;
  std::string again = Play(hurried, image, 1 << 20, &gathered_hurried, 512, /*direct=*/false);
  CHECK(gathered_hurried == blocks);
  CHECK(again == file);
}

// Records how each shard was written.
class WriteLog final : public storage::FsObserver {
 public:
  struct Entry {
    bool direct;
    uint64_t bounced;
  };
  void Wrote(const std::string& path, bool direct, uint64_t bounced) override {
    std::lock_guard lock(mu_);
    writes_[path] = {direct, bounced};
  }
  std::map<std::string, Entry> writes() {
    std::lock_guard lock(mu_);
    return writes_;
  }

 private:
  std::mutex mu_;
  std::map<std::string, Entry> writes_;
};

struct ObserverScope {
  explicit ObserverScope(storage::FsObserver* o) { storage::SetFsObserverForTesting(o); }
  ~ObserverScope() { storage::SetFsObserverForTesting(nullptr); }
};

// Tensors of the given byte sizes at the given offsets into an aligned arena.
struct Layout {
  Arena arena{80 << 20};
  std::vector<TensorRef> refs;
  std::vector<std::string> bytes;
  Layout(const std::vector<size_t>& sizes, const std::vector<size_t>& misalign, uint64_t seed) {
    std::mt19937_64 rng(seed);
    size_t mem = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      mem = RoundUp(mem, kDirectBlock) + misalign[i];
      char* p = arena.base + mem;
      for (size_t k = 0; k < sizes[i]; ++k) p[k] = static_cast<char>(rng());
      bytes.emplace_back(p, sizes[i]);
      refs.push_back({"t" + std::to_string(i), DType::kU8, {sizes[i]}, reinterpret_cast<std::byte*>(p)});
      mem += sizes[i];
    }
  }
};

// Saves the layout twice (borrowed), checks every shard went out with
// O_DIRECT and every tensor reads back bit-exact; returns the bytes copied
// into bounce buffers.
uint64_t SaveAndCheck(const Layout& layout, SnapshotMode mode = SnapshotMode::kBorrow) {
  testing::TempDir dir;
  WriteLog log;
  ObserverScope scope(&log);
  Options o;
  o.staging_memory = 8 << 20;
  o.shard_size = 3 << 20;
  o.snapshot = mode;
  o.keep = 0;
  o.threads = 2;
  o.io.block_size = 1 << 20;
  o.io.queue_depth = 3;
  auto m = CheckpointManager::Open(dir.path(), o);
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  for (int64_t step : {1, 2}) {  // the second save reuses the bounce buffers
    auto h = (*m)->Save(step, layout.refs);
    REQUIRE_MESSAGE(h.ok(), h.status().ToString());
    Status s = h->Wait();
    REQUIRE_MESSAGE(s.ok(), s.ToString());
    auto r = (*m)->Restore(step);
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    REQUIRE(r->tensors.size() == layout.refs.size());
    for (size_t i = 0; i < layout.refs.size(); ++i) {
      const auto& got = r->tensors[i].bytes;
      CHECK_MESSAGE(std::string(reinterpret_cast<const char*>(got.data()), got.size()) == layout.bytes[i],
                    "tensor " << layout.refs[i].name << " of step " << step);
    }
  }
  auto writes = log.writes();
  int shards = 0;
  uint64_t bounced = 0;
  for (const auto& [path, e] : writes) {
    if (path.find("shard-") == std::string::npos) continue;
    ++shards;
    CHECK_MESSAGE(e.direct, path << " was written through the page cache");
    bounced += e.bounced;
  }
  CHECK(shards >= 4);  // two saves of at least two shards each
  return bounced;
}

TEST_CASE("borrowed tensors of odd sizes at odd addresses are written with O_DIRECT and read back bit-exact") {
  // Tensor sizes like a real model's biases and norms (not whole blocks),
  // memory at offsets a numpy allocator could give.
  Layout layout({2'000'003, 1536, 3, 1'500'000, 768 * 2, 4, 3'000'001, 5}, {16, 0, 64, 4095, 16, 1, 0, 32}, 7);
  CHECK(SaveAndCheck(layout) > 0);
}

TEST_CASE("borrowed tensors in whole aligned blocks are written with O_DIRECT without bounce buffers") {
  Layout layout({1 << 20, 8192, 2 << 20, 4096}, {0, 0, 0, 0}, 8);
  CHECK(SaveAndCheck(layout) == 0);
}

TEST_CASE("borrowed tensors at 64-byte-aligned addresses, as jax allocates them, are laid out to go out without copies") {
  // jax's CPU buffers start 64 B-aligned anywhere in a page. The save lays
  // each out at a file offset that agrees with its address modulo 512 (the
  // memory alignment O_DIRECT needs here): only the blocks around each
  // tensor's ends are copied, not the tensors.
  testing::TempDir probe;
  const std::string path = probe.path() + "/probe";
  base::UniqueFd fd(::open(path.c_str(), O_CREAT | O_WRONLY, 0600));
  REQUIRE(fd.valid());
  const size_t mem_align = storage::local::DirectMemoryAlign(fd.get());
  // Two classes modulo 512 (64 and 448) of 16 MiB or more: each worth its
  // own shards (smaller classes are copied, as a file costs more).
  const std::vector<size_t> sizes = {8 << 20, 16 << 20, 8 << 20, 8 << 20, 8 << 20};
  Layout layout(sizes, {64, 4032, 576, 960, 2496}, 9);
  const uint64_t bounced = SaveAndCheck(layout);
  uint64_t total = 0;
  for (size_t s : sizes) total += s;
  if (mem_align > 512) {
    MESSAGE("this file system wants " << mem_align << "-byte-aligned memory for O_DIRECT: only the round trip is checked");
    return;
  }
  // Per save: at most two blocks per tensor and one per shard header. Two saves.
  const uint64_t bound = 2 * (sizes.size() * 2 + sizes.size()) * kDirectBlock;
  CHECK_MESSAGE(bounced <= bound, bounced << " bytes bounced of " << 2 * total);

  // A save the trainer waits for (copy mode with too little staging: Save()
  // returns once written) spends the CPU instead: every byte is copied into
  // the bounce buffers, whose huge pages make fewer, larger device requests.
  const uint64_t waited = SaveAndCheck(layout, SnapshotMode::kCopy);
  CHECK_MESSAGE(waited >= 2 * total, waited << " bytes bounced of " << 2 * total);
}

}  // namespace
}  // namespace ckptio
