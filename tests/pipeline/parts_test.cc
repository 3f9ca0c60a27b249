// The pipeline's parts on their own, each against its contract: the keep
// policy (StepsToPrune), the staging pool, and the plan of a save
// (PlanSave). The manager tests cover them again end to end.

#include <doctest/doctest.h>

#include <condition_variable>
#include <deque>
#include <cstdint>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "ckptio/options.h"
#include "format/crc32c.h"
#include "pipeline/host_part.h"
#include "pipeline/retention.h"
#include "pipeline/save_plan.h"
#include "pipeline/staging.h"

namespace ckptio::pipeline {
namespace {

constexpr uint64_t kPage = StagingPool::kAlign;
constexpr uint64_t kMiB = uint64_t{1} << 20;

uint64_t RoundUp(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

// ---- StepsToPrune ---------------------------------------------------------

struct PruneCase {
  const char* what;
  std::set<int64_t> committed;
  int keep;
  int64_t keep_every;
  std::set<int64_t> untouchable;  // saves in flight, checkpoints being read
  std::vector<int64_t> pruned;
};

TEST_CASE("StepsToPrune keeps the newest keep, the multiples of keep_every and every untouchable step") {
  const std::vector<PruneCase> cases = {
      {"nothing committed", {}, 3, 0, {}, {}},
      {"fewer than keep", {1, 2}, 3, 0, {}, {}},
      {"exactly keep", {1, 2, 3}, 3, 0, {}, {}},
      {"the oldest beyond keep go, oldest first", {1, 2, 3, 4, 5}, 3, 0, {}, {1, 2}},
      {"keep 1 keeps the newest only", {10, 20, 30}, 1, 0, {}, {10, 20}},
      {"keep 0 keeps everything", {1, 2, 3, 4, 5}, 0, 0, {}, {}},
      {"keep 0 keeps everything, keep_every or not", {1, 2, 3, 4, 5}, 0, 2, {}, {}},
      {"steps need not be consecutive", {100, 250, 300, 1000}, 2, 0, {}, {100, 250}},
      {"multiples of keep_every stay", {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}, 2, 5, {}, {1, 2, 3, 4, 6, 7, 8, 9}},
      {"a multiple of keep_every counts among the newest keep", {4, 5, 6, 10}, 2, 5, {}, {4}},
      {"keep_every 1 keeps everything", {1, 2, 3, 4}, 1, 1, {}, {}},
      {"step 0 is a multiple of keep_every", {0, 1, 2, 3}, 1, 2, {}, {1}},
      {"a step in flight or being read stays", {1, 2, 3, 4, 5}, 2, 0, {1, 3}, {2}},
      {"an untouchable step among the newest changes nothing", {1, 2, 3, 4, 5}, 2, 0, {5}, {1, 2, 3}},
      {"an uncommitted save in flight does not count toward keep", {1, 2, 3}, 2, 0, {4}, {1}},
      {"an overwrite of the newest step in flight: the others go", {1, 2, 3}, 1, 0, {3}, {1, 2}},
      {"an overwrite of an old step in flight: that step stays", {1, 2, 3, 4}, 2, 0, {1}, {2}},
      {"every step untouchable: nothing goes", {1, 2, 3}, 1, 0, {1, 2, 3}, {}},
  };
  for (const PruneCase& c : cases) {
    CAPTURE(c.what);
    CHECK(StepsToPrune(c.committed, c.keep, c.keep_every, c.untouchable) == c.pruned);
  }
}

// ---- StagingPool ----------------------------------------------------------

std::unique_ptr<StagingPool> Pool(uint64_t limit, uint64_t resident = 0, StagingPool::GrownFn on_grown = {}) {
  auto pool = StagingPool::Create(limit, resident, std::move(on_grown));
  REQUIRE_MESSAGE(pool.ok(), pool.status().ToString());
  return std::move(pool).value();
}

TEST_CASE("StagingPool's capacity is its limit: a region of the limit fits, one page more never does") {
  auto pool = Pool(3 * kMiB);
  CHECK(pool->capacity() == 3 * kMiB);
  CHECK(pool->free_bytes() == 3 * kMiB);
  CHECK_FALSE(pool->TryAllocate(3 * kMiB + kPage).has_value());
  auto all = pool->TryAllocate(3 * kMiB);
  REQUIRE(all.has_value());
  CHECK(*all == 0);
  CHECK(pool->free_bytes() == 0);
  CHECK_FALSE(pool->TryAllocate(1).has_value());
}

TEST_CASE("StagingPool hands out page-rounded regions first fit and reuses a freed one") {
  auto pool = Pool(4 * kMiB);
  CHECK(pool->TryAllocate(1) == 0);                 // one page
  CHECK(pool->TryAllocate(kPage + 1) == kPage);     // two pages
  CHECK(pool->TryAllocate(kPage) == 3 * kPage);
  CHECK(pool->free_bytes() == 4 * kMiB - 4 * kPage);
  pool->Free(kPage, kPage + 1);                     // the two pages at kPage
  CHECK(pool->free_bytes() == 4 * kMiB - 2 * kPage);
  CHECK(pool->TryAllocate(kPage) == kPage);         // the first free region that fits
  CHECK(pool->TryAllocate(2 * kPage) == 4 * kPage);  // one page is left at 2 * kPage: too small
  CHECK(pool->TryAllocate(kPage) == 2 * kPage);
}

TEST_CASE("StagingPool joins a freed region with free neighbours on both sides") {
  for (bool left_first : {true, false}) {
    CAPTURE(left_first);
    auto pool = Pool(4 * kMiB);
    const uint64_t a = *pool->TryAllocate(kPage), b = *pool->TryAllocate(kPage), c = *pool->TryAllocate(kPage);
    REQUIRE(pool->TryAllocate(pool->free_bytes()).has_value());  // the rest: only a, b and c can come back
    pool->Free(left_first ? a : c, kPage);
    pool->Free(left_first ? c : a, kPage);
    CHECK_FALSE(pool->TryAllocate(2 * kPage).has_value());  // a and c are apart
    pool->Free(b, kPage);
    CHECK(pool->free_bytes() == 3 * kPage);
    CHECK(pool->TryAllocate(3 * kPage) == a);  // a, b and c are one region again
  }
}

TEST_CASE("StagingPool refuses a region larger than any free one while smaller ones still fit") {
  auto pool = Pool(kMiB);
  std::vector<uint64_t> pages;
  while (auto off = pool->TryAllocate(kPage)) pages.push_back(*off);
  REQUIRE(pages.size() == pool->capacity() / kPage);
  for (size_t i = 0; i < pages.size(); i += 2) pool->Free(pages[i], kPage);  // every other page
  CHECK(pool->free_bytes() == pool->capacity() / 2);
  CHECK_FALSE(pool->TryAllocate(2 * kPage).has_value());  // half is free, in one-page holes
  CHECK(pool->TryAllocate(kPage) == pages[0]);
}

TEST_CASE("StagingPool makes resident what TryAllocate hands out, in kGrowStep steps, and no more") {
  auto pool = Pool(64 * kMiB);
  pool->WaitPrefaulted();
  CHECK(pool->resident_bytes() == 0);  // no resident bytes asked for, none handed out
  REQUIRE(pool->TryAllocate(5 * kMiB) == 0);
  pool->WaitPrefaulted();
  CHECK(pool->resident_bytes() == RoundUp(5 * kMiB, StagingPool::kGrowStep));
  REQUIRE(pool->TryAllocate(kMiB) == 5 * kMiB);  // ends inside what is resident
  pool->WaitPrefaulted();
  CHECK(pool->resident_bytes() == RoundUp(5 * kMiB, StagingPool::kGrowStep));
  REQUIRE(pool->TryAllocate(4 * kMiB) == 6 * kMiB);
  pool->WaitPrefaulted();
  CHECK(pool->resident_bytes() == RoundUp(10 * kMiB, StagingPool::kGrowStep));
}

TEST_CASE("StagingPool makes Create's resident bytes resident at once, never past its limit") {
  auto pool = Pool(64 * kMiB, 3 * kMiB);
  pool->WaitPrefaulted();
  CHECK(pool->resident_bytes() == RoundUp(3 * kMiB, StagingPool::kGrowStep));
  auto exact = Pool(3 * kMiB, 3 * kMiB);  // an explicit staging_memory: all of it
  exact->WaitPrefaulted();
  CHECK(exact->resident_bytes() == 3 * kMiB);
}

TEST_CASE("StagingPool created held pre-faults nothing until the last hold is released") {
  auto created = StagingPool::Create(64 * kMiB, 8 * kMiB, {}, /*held=*/true);
  REQUIRE(created.ok());
  auto pool = std::move(created).value();
  pool->HoldPrefault();  // a second hold: counted
  REQUIRE(pool->TryAllocate(16 * kMiB) == 0);  // a save still gets its region (and faults it in itself)
  CHECK(pool->resident_bytes() == 0);
  pool->ReleasePrefault();
  CHECK(pool->resident_bytes() == 0);  // one hold left
  pool->ReleasePrefault();
  pool->WaitPrefaulted();  // returns only once the thread ran again
  CHECK(pool->resident_bytes() == 16 * kMiB);
}

TEST_CASE("StagingPool tells on_grown each time the resident part has caught up") {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<uint64_t> grown;
  char* seen_base = nullptr;
  auto pool = Pool(64 * kMiB, 0, [&](char* base, uint64_t resident) {
    std::lock_guard lock(mu);
    seen_base = base;
    grown.push_back(resident);
    cv.notify_all();
  });
  auto wait_for = [&](size_t calls) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return grown.size() >= calls; });
  };
  REQUIRE(pool->TryAllocate(kMiB).has_value());
  wait_for(1);
  REQUIRE(pool->TryAllocate(4 * kMiB).has_value());
  wait_for(2);
  std::lock_guard lock(mu);
  CHECK(grown == std::vector<uint64_t>{2 * kMiB, 6 * kMiB});
  CHECK(seen_base == pool->base());
}

// ---- PlanSave -------------------------------------------------------------

struct Tensors {
  std::deque<std::vector<std::byte>> buffers;  // a deque: adding one moves none
  std::vector<TensorRef> refs;
  // A U8 tensor of `bytes` bytes.
  Tensors& U8(std::string name, uint64_t bytes) {
    buffers.emplace_back(bytes, std::byte{1});
    refs.push_back({std::move(name), DType::kU8, {bytes}, buffers.back().data()});
    return *this;
  }
};

Options PlanOptions(uint64_t shard_size, SnapshotMode mode = SnapshotMode::kCopy) {
  Options o;
  o.shard_size = shard_size;
  o.snapshot = mode;
  return o;
}

SavePlan Plan(const std::vector<TensorRef>& refs, const Options& o, int64_t step = 7) {
  auto plan = PlanSave(step, refs, o);
  REQUIRE_MESSAGE(plan.ok(), plan.status().ToString());
  return std::move(plan).value();
}

// The spec indices of each planned shard.
std::vector<std::vector<size_t>> Layout(const SavePlan& plan) {
  std::vector<std::vector<size_t>> out;
  for (const format::PlannedShard& s : plan.shards) {
    out.emplace_back();
    for (const format::PlannedTensor& t : s.tensors) out.back().push_back(t.index);
  }
  return out;
}

using Groups = std::vector<std::vector<size_t>>;

TEST_CASE("PlanSave packs tensors in the caller's order into shards of at most shard_size data bytes") {
  Tensors t;
  t.U8("a", 400'000).U8("b", 400'000).U8("c", 400'000).U8("d", 400'000).U8("e", 400'000);
  const SavePlan plan = Plan(t.refs, PlanOptions(kMiB));
  CHECK(Layout(plan) == Groups{{0, 1}, {2, 3}, {4}});
  REQUIRE(plan.specs.size() == 5);
  for (size_t i = 0; i < 5; ++i) {
    CHECK(plan.specs[i].name == t.refs[i].name);
    CHECK(plan.sources[i] == t.refs[i].data);
  }
  CHECK(plan.step == 7);
}

TEST_CASE("PlanSave gives a tensor larger than shard_size a shard of its own") {
  Tensors t;
  t.U8("small", 100'000).U8("big", 3 * kMiB).U8("tail", 100'000);
  const SavePlan plan = Plan(t.refs, PlanOptions(kMiB));
  CHECK(Layout(plan) == Groups{{0}, {1}, {2}});
  CHECK(plan.shards[1].file_size == plan.shards[1].prefix.size() + 3 * kMiB);
}

TEST_CASE("PlanSave plans empty and scalar tensors, and an empty one may have no data") {
  double scalar = 2.5;
  const std::vector<TensorRef> refs = {{"empty", DType::kF32, {0, 3}, nullptr}, {"scalar", DType::kF64, {}, &scalar}};
  const SavePlan plan = Plan(refs, PlanOptions(kMiB));
  REQUIRE(plan.shards.size() == 1);
  CHECK(plan.specs[0].bytes == 0);
  CHECK(plan.specs[1].bytes == 8);
  const format::PlannedShard& s = plan.shards[0];
  CHECK(s.tensors[0].offset == s.prefix.size());
  CHECK(s.tensors[1].offset == s.prefix.size());  // the empty tensor takes no room
  CHECK(s.file_size == s.prefix.size() + 8);
  CHECK(plan.checkpoint_bytes == s.file_size);
}

TEST_CASE("PlanSave of no tensors plans no shards and no staging") {
  const SavePlan plan = Plan({}, PlanOptions(kMiB));
  CHECK(plan.shards.empty());
  CHECK(plan.staging_bytes == 0);
  CHECK(plan.checkpoint_bytes == 0);
}

TEST_CASE("PlanSave starts each shard's data on a 4 KiB boundary and packs its tensors contiguously") {
  Tensors t;
  t.U8("a", 1000).U8("b", 3).U8("c", 5000).U8("d", 70'000).U8("e", 1).U8("f", 9999);
  const SavePlan plan = Plan(t.refs, PlanOptions(40'000));
  REQUIRE(plan.shards.size() > 1);
  for (const format::PlannedShard& s : plan.shards) {
    CAPTURE(s.name);
    CHECK(s.prefix.size() % kPage == 0);  // the header is padded: data is O_DIRECT-aligned
    uint64_t end = s.prefix.size();
    for (const format::PlannedTensor& pt : s.tensors) {
      CHECK(pt.offset == end);  // safetensors allows no holes
      end += pt.bytes;
    }
    CHECK(s.file_size == end);
  }
}

TEST_CASE("PlanSave in copy mode stages each shard's whole file, each on a 4 KiB boundary") {
  Tensors t;
  t.U8("a", 700'000).U8("b", 700'000).U8("c", 5);
  const SavePlan plan = Plan(t.refs, PlanOptions(kMiB));
  REQUIRE(plan.shards.size() == 2);
  CHECK_FALSE(plan.borrow);
  uint64_t offset = 0, files = 0;
  for (size_t i = 0; i < plan.shards.size(); ++i) {
    CHECK(plan.image_offset[i] == offset);
    offset += RoundUp(plan.shards[i].file_size, kPage);
    files += plan.shards[i].file_size;
  }
  CHECK(plan.staging_bytes == offset);
  CHECK(plan.checkpoint_bytes == files);
}

TEST_CASE("PlanSave in borrow mode stages the shard headers only") {
  Tensors t;
  t.U8("a", 700'000).U8("b", 700'000).U8("c", 5);
  const SavePlan copy = Plan(t.refs, PlanOptions(kMiB));
  const SavePlan borrow = Plan(t.refs, PlanOptions(kMiB, SnapshotMode::kBorrow));
  CHECK(borrow.borrow);
  REQUIRE(borrow.shards.size() == 2);
  CHECK(borrow.image_offset == std::vector<uint64_t>{0, borrow.shards[0].prefix.size()});
  CHECK(borrow.staging_bytes == borrow.shards[0].prefix.size() + borrow.shards[1].prefix.size());
  CHECK(borrow.checkpoint_bytes == copy.checkpoint_bytes);  // the same files either way
}

TEST_CASE("PlanSave of borrowed tensors groups them by address modulo the storage's, when a group is worth a file") {
  // Addresses as jax gives them (64-byte-aligned anywhere in a page); never
  // read by PlanSave. Two classes of 16 MiB or more get shards of their own,
  // laid out to agree with the addresses; the small classes' tensors join
  // the largest class (they are copied when written).
  const uint64_t base = uint64_t{1} << 40;
  auto at = [&](uint64_t offset) { return reinterpret_cast<std::byte*>(base + offset); };
  std::vector<TensorRef> refs = {
      {"big64", DType::kU8, {16 * kMiB}, at(64)},          // class 64: 24 MiB
      {"small0", DType::kU8, {4096}, at(100 * kMiB)},      // class 0: 4 KiB
      {"big448", DType::kU8, {20 * kMiB}, at(200 * kMiB + 448)},  // class 448: 20 MiB
      {"more64", DType::kU8, {8 * kMiB}, at(300 * kMiB + 576)},   // class 64
      {"small128", DType::kU8, {1000}, at(400 * kMiB + 128)},     // class 128: 1000 B
  };
  auto planned = PlanSave(1, refs, PlanOptions(64 * kMiB, SnapshotMode::kBorrow), std::nullopt, 512);
  REQUIRE_MESSAGE(planned.ok(), planned.status().ToString());
  CHECK(Layout(*planned) == Groups{{0, 1, 3, 4}, {2}});
  for (const format::PlannedShard& s : planned->shards) {
    for (const format::PlannedTensor& t : s.tensors) {
      if (refs[t.index].name.starts_with("small")) continue;
      const uint64_t residue = reinterpret_cast<uintptr_t>(refs[t.index].data) % 512;
      CAPTURE(refs[t.index].name);
      CHECK(t.offset % 512 == residue);
    }
  }
  // No modulus (GCS, or staged): the caller's order, one shard.
  CHECK(Layout(Plan(refs, PlanOptions(64 * kMiB, SnapshotMode::kBorrow))) == Groups{{0, 1, 2, 3, 4}});
}

TEST_CASE("MakeImages points copy-mode shards into staging and borrow-mode tensors at the caller's buffers") {
  Tensors t;
  t.U8("a", 5000).U8("empty", 0).U8("b", 3);
  std::vector<char> region(64 * kPage);
  const SavePlan copy = Plan(t.refs, PlanOptions(kMiB));
  auto images = MakeImages(copy, region.data());
  REQUIRE(images.size() == 1);
  REQUIRE(images[0].segments.size() == 1);  // the whole file image, from staging
  CHECK(images[0].segments[0].data == region.data());
  CHECK(images[0].segments[0].len == copy.shards[0].file_size);

  const SavePlan borrow = Plan(t.refs, PlanOptions(kMiB, SnapshotMode::kBorrow));
  images = MakeImages(borrow, region.data());
  REQUIRE(images.size() == 1);
  const auto& segs = images[0].segments;
  REQUIRE(segs.size() == 3);  // the header from staging, then a and b (the empty one has no bytes)
  CHECK(segs[0].data == region.data());
  CHECK(segs[0].len == borrow.shards[0].prefix.size());
  CHECK(segs[1].data == t.refs[0].data);
  CHECK(segs[1].offset == borrow.shards[0].prefix.size());
  CHECK(segs[2].data == t.refs[2].data);
  CHECK(segs[2].offset == borrow.shards[0].prefix.size() + 5000);
}

TEST_CASE("PlanSave records each shard header's CRC32C") {
  Tensors t;
  t.U8("a", 700'000).U8("b", 700'000);
  const SavePlan plan = Plan(t.refs, PlanOptions(kMiB));
  REQUIRE(plan.prefix_crc.size() == plan.shards.size());
  for (size_t i = 0; i < plan.shards.size(); ++i) {
    CHECK(plan.prefix_crc[i] == format::Crc32c(plan.shards[i].prefix.data(), plan.shards[i].prefix.size()));
  }
}

TEST_CASE("PlanSave names a multi-host process's shards after it") {
  Tensors t;
  t.U8("a", 10);
  Options o = PlanOptions(kMiB);
  o.multihost.process_count = 4;
  o.multihost.process_index = 3;
  CHECK(Plan(t.refs, o).shards[0].name == "shard-p00003-00000.safetensors");
}

TEST_CASE("PlanSave refuses a negative step and a tensor with bytes but no data, naming them") {
  Tensors t;
  t.U8("a", 10);
  CHECK(PlanSave(-1, t.refs, PlanOptions(kMiB)).status().message() == "step must be >= 0, got -1");
  const std::vector<TensorRef> null_data = {{"w", DType::kF32, {4}, nullptr}};
  auto plan = PlanSave(1, null_data, PlanOptions(kMiB));
  CHECK(plan.status().code() == StatusCode::kInvalidArgument);
  CHECK(plan.status().message() == "tensor \"w\": data is null but it holds 16 bytes");
}

}  // namespace
}  // namespace ckptio::pipeline

// ---- Multi-host files (host_part.h) ----------------------------------------

namespace ckptio::pipeline {
namespace {

TEST_CASE("FileOwner reads a process's own file names, also as copied under another step's name") {
  CHECK(FileOwner("shard-p00003-00000.safetensors") == 3);
  CHECK(FileOwner("shard-p01024-00017.safetensors") == 1024);
  CHECK(FileOwner("checkpoint_1.shard-p00012-00001.safetensors") == 12);
  CHECK_FALSE(FileOwner("shard-00000.safetensors"));            // one process's
  CHECK_FALSE(FileOwner("replica-p00003-00000.safetensors"));   // local copies belong to no process's part
  CHECK_FALSE(FileOwner("shard-p0003-00000.safetensors"));      // four digits
  CHECK_FALSE(FileOwner("shard-p00003x00000.safetensors"));
  CHECK_FALSE(FileOwner("shard-p00003"));
  CHECK(IsLocalCopyFile("replica-p00003-00000.safetensors"));
  CHECK_FALSE(IsLocalCopyFile("shard-p00003-00000.safetensors"));
}

TEST_CASE("PlanSave puts local copies in replica files of their own, after the process's own files") {
  Options o;
  o.shard_size = 1 << 20;
  o.multihost.process_index = 3;
  o.multihost.process_count = 4;
  o.tiers.remote = "gs://b/run";
  std::vector<std::vector<std::byte>> data;
  std::vector<TensorRef> refs;
  for (int i = 0; i < 4; ++i) {
    data.emplace_back(4096);
    refs.push_back({"t" + std::to_string(i), DType::kU8, {4096}, data.back().data()});
    refs.back().local_copy = i % 2 == 1;
  }
  auto plan = PlanSave(7, refs, o);
  REQUIRE_MESSAGE(plan.ok(), plan.status().ToString());
  REQUIRE(plan->shards.size() == 2);
  CHECK(plan->shards[0].name == "shard-p00003-00000.safetensors");
  CHECK(plan->shards[1].name == "replica-p00003-00000.safetensors");
  std::vector<size_t> own, copies;
  for (const format::PlannedTensor& t : plan->shards[0].tensors) own.push_back(t.index);
  for (const format::PlannedTensor& t : plan->shards[1].tensors) copies.push_back(t.index);
  CHECK(own == std::vector<size_t>{0, 2});
  CHECK(copies == std::vector<size_t>{1, 3});
}

}  // namespace
}  // namespace ckptio::pipeline
