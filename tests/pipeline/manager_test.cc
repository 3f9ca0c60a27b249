// CheckpointManager on the real file system.

#include <doctest/doctest.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "ckptio/checkpoint_manager.h"
#include "pipeline/replication_journal.h"
#include "base/dtype.h"
#include "storage/local_storage.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// Staging for the largest saves here, several at once.
Options SmallOptions() { return testing::SmallOptions(64 << 20); }

std::unique_ptr<CheckpointManager> OpenOrDie(const std::string& root, const Options& o) {
  auto m = CheckpointManager::Open(root, o);
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  return std::move(m).value();
}

// Holds the first shard write of the managers opened while it is installed,
// on their loop thread, until Release(): that save keeps its staging region
// and its place in flight meanwhile, so a test can make the next save meet
// a busy manager for certain, without racing the disk.
class HeldWrite final : public storage::FsObserver {
 public:
  HeldWrite() { storage::SetFsObserverForTesting(this); }
  ~HeldWrite() {
    Release();
    storage::SetFsObserverForTesting(nullptr);
  }
  int Inject(Op op, const std::string& path) override {
    (void)path;
    if (op != Op::kWrite) return 0;
    std::unique_lock lock(mu_);
    if (held_) return 0;
    held_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return released_; });
    return 0;
  }
  void WaitUntilHeld() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return held_; });
  }
  void Release() {
    {
      std::lock_guard lock(mu_);
      released_ = true;
    }
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool held_ = false;
  bool released_ = false;
};

// A manager whose first shard write is held. The members are in this order
// so that the observer outlives the manager and the write is released
// before the manager's destructor waits for its saves.
struct HeldManager {
  HeldManager(const std::string& root, const Options& o) : manager(OpenOrDie(root, o)) {}
  ~HeldManager() { held.Release(); }
  HeldWrite held;
  std::unique_ptr<CheckpointManager> manager;
};

// True while thread `tid` of this process sleeps in a futex (a mutex or a
// condition variable), as a save waiting for room does: the kernel's word,
// so the manager needs no hook for a test to see that a save waits.
bool SleepsInFutex(pid_t tid) {
  std::ifstream f("/proc/self/task/" + std::to_string(tid) + "/syscall");
  long nr = -1;
  return static_cast<bool>(f >> nr) && nr == SYS_futex;  // "running" reads as no number
}

// A tensor whose bytes are a deterministic function of (name, step).
struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<uint64_t> shape;
  Bytes bytes;
  TensorRef ref() const { return {name, dtype, shape, bytes.data()}; }
};

OwnedTensor MakeTensor(std::string name, DType dtype, std::vector<uint64_t> shape, int64_t step) {
  uint64_t n = base::TensorBytes(dtype, shape).value();
  OwnedTensor t{std::move(name), dtype, std::move(shape), Bytes(n)};
  std::mt19937_64 rng(std::hash<std::string>{}(t.name) ^ static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull);
  for (auto& b : t.bytes) b = static_cast<std::byte>(rng());
  return t;
}

std::vector<TensorRef> Refs(const std::vector<OwnedTensor>& ts) {
  std::vector<TensorRef> r;
  for (const auto& t : ts) r.push_back(t.ref());
  return r;
}

std::vector<OwnedTensor> State(int64_t step, size_t n = 6, uint64_t elems = 100'000) {
  std::vector<OwnedTensor> ts;
  for (size_t i = 0; i < n; ++i) {
    ts.push_back(MakeTensor("layer" + std::to_string(i) + "/w", DType::kF32, {elems / 4, 4}, step));
  }
  return ts;
}

// XORs the byte at `at` of file `path` with `mask` (twice: back as it was).
void FlipByteAt(const std::string& path, uint64_t at, char mask) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  REQUIRE(f.good());
  f.seekg(static_cast<std::streamoff>(at));
  char c;
  f.read(&c, 1);
  c ^= mask;
  f.seekp(static_cast<std::streamoff>(at));
  f.write(&c, 1);
}

void CheckEqual(const RestoredCheckpoint& r, const std::vector<OwnedTensor>& want) {
  REQUIRE(r.tensors.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    CHECK(r.tensors[i].name == want[i].name);
    CHECK(r.tensors[i].dtype == want[i].dtype);
    CHECK(r.tensors[i].shape == want[i].shape);
    CHECK_MESSAGE(r.tensors[i].bytes == want[i].bytes, "tensor " << want[i].name);
  }
}

std::vector<std::string> DirNames(const std::string& root) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root)) {
    if (e.is_directory()) names.push_back(e.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST_CASE("every dtype round-trips bit-exact") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  std::vector<OwnedTensor> ts;
  for (DType d : base::AllDTypes()) {
    ts.push_back(MakeTensor(std::string(base::DTypeName(d)), d, {3, 5, 7}, 1));
  }
  auto refs = Refs(ts);
  auto h = m->Save(1, refs, R"({"epoch": 3, "note": "all dtypes"})");
  REQUIRE_MESSAGE(h.ok(), h.status().ToString());
  Status s = h->Wait();
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  auto r = m->Restore(1);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CheckEqual(*r, ts);
  CHECK(nlohmann::json::parse(r->metadata_json) == nlohmann::json{{"epoch", 3}, {"note", "all dtypes"}});
}

TEST_CASE("a restart with an explicit staging_memory pre-faults it after the first restore, the first save, or WaitUntilReady") {
  TempDir dir;
  auto ts = State(5);
  auto refs = Refs(ts);
  {
    auto m = OpenOrDie(dir.path(), SmallOptions());
    REQUIRE(m->Save(5, refs)->Wait().ok());
  }
  for (const char* first : {"restore", "save", "wait", "held restore"}) {
    CAPTURE(first);
    auto m = OpenOrDie(dir.path(), SmallOptions());  // the root holds step 5: a restart
    if (std::string(first) == "restore") {
      auto r = m->Restore();
      REQUIRE(r.ok());
      CheckEqual(*r, ts);
    } else if (std::string(first) == "save") {
      REQUIRE(m->Save(6, refs)->Wait().ok());
    } else if (std::string(first) == "held restore") {
      m->HoldPrefault();  // a restore of several calls
      auto r = m->Restore();
      REQUIRE(r.ok());
      CheckEqual(*r, ts);
      m->ReleasePrefault();
    }
    m->WaitUntilReady();  // returns: nothing holds the pre-fault any more (a hold left would hang here)
    CHECK(m->stats().staging_resident_bytes == SmallOptions().staging_memory);
  }
}

TEST_CASE("a save returns once the snapshot is taken, so the caller may overwrite its buffers") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(7);
  const auto expected = ts;
  auto refs = Refs(ts);
  auto h = m->Save(7, refs);
  REQUIRE(h.ok());
  for (auto& t : ts) std::fill(t.bytes.begin(), t.bytes.end(), std::byte{0xEE});
  REQUIRE(h->Wait().ok());
  auto r = m->Restore();
  REQUIRE(r.ok());
  CHECK(r->step == 7);
  CheckEqual(*r, expected);
}

TEST_CASE("restore into caller buffers fills them with the saved bytes") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(3, 4, 300'000);  // tensors span several shards
  auto refs = Refs(ts);
  REQUIRE(m->Save(3, refs)->Wait().ok());
  std::vector<Bytes> bufs;
  std::vector<MutableTensorRef> targets;
  for (const auto& t : ts) bufs.emplace_back(t.bytes.size());
  for (size_t i = 0; i < ts.size(); ++i) targets.push_back({ts[i].name, ts[i].dtype, ts[i].shape, bufs[i].data()});
  auto step = m->RestoreInto(std::nullopt, targets);
  REQUIRE_MESSAGE(step.ok(), step.status().ToString());
  CHECK(*step == 3);
  for (size_t i = 0; i < ts.size(); ++i) CHECK(bufs[i] == ts[i].bytes);
}

TEST_CASE("a restore of some tensors opens only their shards") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(3, 4, 300'000);  // 1.2 MB each, shard_size 1 MiB: one shard per tensor
  auto refs = Refs(ts);
  REQUIRE(m->Save(3, refs)->Wait().ok());
  fs::remove(dir / "checkpoint_3/shard-00000.safetensors");  // holds layer0/w
  Bytes buf(ts[2].bytes.size());
  std::vector<MutableTensorRef> one = {{ts[2].name, ts[2].dtype, ts[2].shape, buf.data()}};
  auto step = m->RestoreInto(3, one);
  REQUIRE_MESSAGE(step.ok(), step.status().ToString());
  CHECK(buf == ts[2].bytes);
  // The whole checkpoint needs the missing shard: damage (Corruption), not a bad request.
  auto all = m->Restore(3);
  CHECK(all.status().code() == StatusCode::kCorruption);
  CHECK(all.status().message().find("shard-00000.safetensors") != std::string::npos);
}

TEST_CASE("restore of byte ranges: every tensor read is CRC-checked, partial slices included") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(5, 4, 300'000);
  auto refs = Refs(ts);
  REQUIRE(m->Save(5, refs)->Wait().ok());
  const uint64_t n = ts[1].bytes.size();
  Bytes whole(n), part(5000), tail(16);
  std::vector<TensorSlice> slices = {{ts[1].name, 0, n, whole.data()},
                                     {ts[3].name, 1000, part.size(), part.data()},
                                     {ts[3].name, ts[3].bytes.size() - 16, 16, tail.data()}};
  auto step = m->RestoreSlices(std::nullopt, slices);
  REQUIRE_MESSAGE(step.ok(), step.status().ToString());
  CHECK(*step == 5);
  CHECK(whole == ts[1].bytes);
  CHECK(std::equal(part.begin(), part.end(), ts[3].bytes.begin() + 1000));
  CHECK(std::equal(tail.begin(), tail.end(), ts[3].bytes.end() - 16));
  // Out of range (and an offset + length that would overflow): refused, nothing read.
  std::vector<TensorSlice> over = {{ts[3].name, ts[3].bytes.size() - 15, 16, tail.data()}};
  auto bad = m->RestoreSlices(5, over);
  CHECK(bad.status().code() == StatusCode::kInvalidArgument);
  CHECK(bad.status().message() == "tensor \"layer3/w\" has 1200000 bytes: the slice of 16 bytes at offset 1199985 "
                                  "is out of range");
  std::vector<TensorSlice> wrap = {{ts[3].name, 8, UINT64_MAX - 4, tail.data()}};
  CHECK(m->RestoreSlices(5, wrap).status().code() == StatusCode::kInvalidArgument);
  std::vector<TensorSlice> unknown = {{"nope", 0, 1, tail.data()}};
  CHECK(m->RestoreSlices(5, unknown).status().code() == StatusCode::kNotFound);
  // A flipped byte at 200,000 in layer1/w's data: the whole slice fails its
  // CRC32C, and so does a slice that does not cover the byte (the rest of
  // the tensor is read for the check), alone or with others.
  const std::string shard = dir / "checkpoint_5/shard-00001.safetensors";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(4096 + 200'000);
    char c;
    f.read(&c, 1);
    c ^= 0x01;
    f.seekp(4096 + 200'000);
    f.write(&c, 1);
  }
  auto corrupt = m->RestoreSlices(5, std::vector<TensorSlice>{{ts[1].name, 0, n, whole.data()}});
  CHECK(corrupt.status().code() == StatusCode::kCorruption);
  CHECK(corrupt.status().message().find(shard + ": tensor \"layer1/w\"") == 0);
  Bytes first(100'000);
  auto partial = m->RestoreSlices(5, std::vector<TensorSlice>{{ts[1].name, 0, first.size(), first.data()}});
  CHECK(partial.status().code() == StatusCode::kCorruption);
  CHECK(partial.status().message().find(shard + ": tensor \"layer1/w\"") == 0);
  CHECK(partial.status().message().find("CRC32C mismatch") != std::string::npos);
  Bytes second(n - 300'000);  // [300,000, n): with `first`, two gaps around the flipped byte
  auto two = m->RestoreSlices(5, std::vector<TensorSlice>{{ts[1].name, 0, first.size(), first.data()},
                                                          {ts[1].name, 300'000, second.size(), second.data()}});
  CHECK(two.status().code() == StatusCode::kCorruption);
  // The other tensors of the shard are intact: a slice of one still reads.
  CHECK(m->RestoreSlices(5, std::vector<TensorSlice>{{ts[3].name, 1000, part.size(), part.data()}}).ok());
}

TEST_CASE("restore of byte ranges: slices that tile, overlap or leave gaps in a tensor read its exact bytes") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(6, 2, 5'000'000);  // 20 MB tensors: more than one 16 MiB read piece each
  auto refs = Refs(ts);
  REQUIRE(m->Save(6, refs)->Wait().ok());
  const Bytes& want = ts[1].bytes;
  const uint64_t n = want.size();
  // Halves that tile it; two that overlap in part; a slice inside another; an
  // empty one; one with gaps on both sides (the rest read for the CRC).
  const std::vector<std::vector<std::pair<uint64_t, uint64_t>>> cases = {
      {{0, n / 2}, {n / 2, n - n / 2}},
      {{0, n / 2 + 4097}, {n / 2 - 123, n - (n / 2 - 123)}},
      {{1000, 20'000}, {0, n}, {5000, 1}},
      {{n / 3, 0}, {n - 16, 16}, {0, 16}},
      {{17 << 20, 1 << 20}},
  };
  for (const auto& slices : cases) {
    std::vector<Bytes> bufs;
    std::vector<TensorSlice> asked;
    for (auto [offset, len] : slices) bufs.emplace_back(len);
    for (size_t i = 0; i < slices.size(); ++i) asked.push_back({ts[1].name, slices[i].first, slices[i].second, bufs[i].data()});
    auto read = m->RestoreSlices(6, asked);
    REQUIRE_MESSAGE(read.ok(), read.status().ToString());
    for (size_t i = 0; i < slices.size(); ++i) {
      CHECK(std::equal(bufs[i].begin(), bufs[i].end(), want.begin() + static_cast<ptrdiff_t>(slices[i].first)));
    }
  }
  // A flipped byte in the part two overlapping slices share: found.
  const std::string shard = dir / "checkpoint_6/shard-00001.safetensors";
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    REQUIRE(f.good());
    f.seekg(4096 + n / 2);
    char c;
    f.read(&c, 1);
    c ^= 0x40;
    f.seekp(4096 + n / 2);
    f.write(&c, 1);
  }
  Bytes a(n / 2 + 4097), b(n - (n / 2 - 123));
  auto bad = m->RestoreSlices(6, std::vector<TensorSlice>{{ts[1].name, 0, a.size(), a.data()},
                                                          {ts[1].name, n / 2 - 123, b.size(), b.data()}});
  CHECK(bad.status().code() == StatusCode::kCorruption);
  CHECK(bad.status().message().find(shard + ": tensor \"layer1/w\"") == 0);
}

TEST_CASE("restore of byte ranges: slices of rows (column strips) read their exact bytes, straight into place") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(7, 2, 5'000'000);  // 20 MB: more than one 16 MiB read piece
  REQUIRE(m->Save(7, Refs(ts))->Wait().ok());
  const Bytes& want = ts[1].bytes;
  const uint64_t cols = 4000, rows = want.size() / cols;  // seen as a 5000 x 4000-byte matrix
  REQUIRE(rows * cols == want.size());
  // Columns [c0, c1) of rows [r0, r1) into a buffer of their own.
  struct Strip {
    uint64_t r0, r1, c0, c1;
  };
  auto read = [&](const std::vector<Strip>& strips, std::vector<Bytes>* out) {
    std::vector<TensorSlice> asked;
    out->clear();
    for (const Strip& s : strips) out->emplace_back((s.r1 - s.r0) * (s.c1 - s.c0));
    for (size_t i = 0; i < strips.size(); ++i) {
      const Strip& s = strips[i];
      asked.push_back({ts[1].name, s.r0 * cols + s.c0, s.c1 - s.c0, (*out)[i].data(), s.r1 - s.r0, cols, s.c1 - s.c0});
    }
    return m->RestoreSlices(7, asked);
  };
  auto expect = [&](const Strip& s, const Bytes& got) {
    Bytes w;
    for (uint64_t r = s.r0; r < s.r1; ++r) {
      w.insert(w.end(), want.begin() + static_cast<ptrdiff_t>(r * cols + s.c0),
               want.begin() + static_cast<ptrdiff_t>(r * cols + s.c1));
    }
    return got == w;
  };
  // Strips that tile the matrix (15,000 rows in all: more than one vectored
  // read's 1,024 buffers); one strip alone (the rest read for the CRC); strips
  // that overlap, one inside another; part of the rows only.
  const std::vector<std::vector<Strip>> cases = {
      {{0, rows, 0, 1000}, {0, rows, 1000, 2500}, {0, rows, 2500, cols}},
      {{0, rows, 1000, 1008}},
      {{0, rows, 0, 2000}, {0, rows, 1500, cols}, {10, 20, 100, 200}},
      {{4000, 4500, 3000, cols}, {4100, 4101, 0, cols}},
  };
  for (const auto& strips : cases) {
    std::vector<Bytes> got;
    auto step = read(strips, &got);
    REQUIRE_MESSAGE(step.ok(), step.status().ToString());
    for (size_t i = 0; i < strips.size(); ++i) CHECK(expect(strips[i], got[i]));
  }
  // With a plain range of the same tensor over its first 3 rows: both exact.
  Bytes head(3 * cols + 17), strip(rows * 10);
  auto mixed = m->RestoreSlices(7, std::vector<TensorSlice>{{ts[1].name, 0, head.size(), head.data()},
                                                            {ts[1].name, 5, 10, strip.data(), rows, cols, 10}});
  REQUIRE_MESSAGE(mixed.ok(), mixed.status().ToString());
  CHECK(std::equal(head.begin(), head.end(), want.begin()));
  CHECK(expect({0, rows, 5, 15}, strip));
  // Bad strides and rows past the end: refused with what was wrong, nothing read.
  Bytes small(100);
  auto narrow = m->RestoreSlices(7, std::vector<TensorSlice>{{ts[1].name, 0, 10, small.data(), 2, 5, 10}});
  CHECK(narrow.status().code() == StatusCode::kInvalidArgument);
  CHECK(narrow.status().message() == "tensor \"layer1/w\": a slice of 2 rows of 10 bytes needs a stride and a "
                                     "dst_stride of at least 10, got 5 and 10");
  auto past = m->RestoreSlices(7, std::vector<TensorSlice>{{ts[1].name, 3990, 10, small.data(), rows + 1, cols, 10}});
  CHECK(past.status().code() == StatusCode::kInvalidArgument);
  CHECK(past.status().message() == "tensor \"layer1/w\" has 20000000 bytes: the slice of 5001 rows of 10 bytes at "
                                   "offset 3990 (stride 4000) is out of range");
  auto huge = m->RestoreSlices(7, std::vector<TensorSlice>{{ts[1].name, 0, 1, small.data(), UINT64_MAX, UINT64_MAX / 2, 1}});
  CHECK(huge.status().code() == StatusCode::kInvalidArgument);
  auto wraps = m->RestoreSlices(7, std::vector<TensorSlice>{{ts[1].name, 0, 1, small.data(), 2, 1, UINT64_MAX}});
  CHECK(wraps.status().code() == StatusCode::kInvalidArgument);
  CHECK(wraps.status().message().find("run past the end of the address space") != std::string::npos);
  // A flipped byte in a column no strip asks for, then in one a strip reads:
  // both found (the whole tensor is checked).
  const std::string shard = dir / "checkpoint_7/shard-00001.safetensors";
  auto flip = [&](uint64_t at) { FlipByteAt(shard, 4096 + at, 0x10); };
  for (uint64_t at : {uint64_t{2500} * cols + 3000, uint64_t{2500} * cols + 1004}) {
    flip(at);
    std::vector<Bytes> got;
    auto bad = read({{0, rows, 1000, 1008}}, &got);
    CHECK(bad.status().code() == StatusCode::kCorruption);
    CHECK(bad.status().message().find(shard + ": tensor \"layer1/w\"") == 0);
    flip(at);  // back: the next read sees only its own flip
    CHECK(read({{0, rows, 1000, 1008}}, &got).ok());
  }
}

TEST_CASE("restore of byte ranges: millions of short rows are read in windows, each byte exact and checked") {
  // 1.5 million rows of 4 bytes (and 375,000 of 8, overlapping them) over
  // two tensors: many windows of one tensor, read in groups in turn, the
  // running CRC32C carried from one group to the next.
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(8, 3, 1'500'000);  // 6 MB each
  REQUIRE(m->Save(8, Refs(ts))->Wait().ok());
  const uint64_t cols = 16, rows = ts[1].bytes.size() / cols;
  auto strips = [&](const std::string& name, std::vector<std::pair<uint64_t, uint64_t>> widths,
                    std::vector<Bytes>* out) {
    std::vector<TensorSlice> asked;
    out->clear();
    for (auto [c0, c1] : widths) out->emplace_back(rows * (c1 - c0));
    for (size_t i = 0; i < widths.size(); ++i) {
      const uint64_t w = widths[i].second - widths[i].first;
      asked.push_back({name, widths[i].first, w, (*out)[i].data(), rows, cols, w});
    }
    return asked;
  };
  auto expect = [&](const Bytes& want, uint64_t c0, uint64_t c1, const Bytes& got) {
    for (uint64_t r = 0; r < rows; ++r) {
      if (!std::equal(got.begin() + static_cast<ptrdiff_t>(r * (c1 - c0)),
                      got.begin() + static_cast<ptrdiff_t>((r + 1) * (c1 - c0)),
                      want.begin() + static_cast<ptrdiff_t>(r * cols + c0))) {
        return false;
      }
    }
    return true;
  };
  const std::vector<std::pair<uint64_t, uint64_t>> of1 = {{0, 4}, {4, 8}, {8, 12}, {12, 16}, {2, 10}};
  std::vector<Bytes> got1, got2;
  std::vector<TensorSlice> asked = strips(ts[1].name, of1, &got1);
  for (TensorSlice& s : strips(ts[2].name, {{4, 8}}, &got2)) asked.push_back(s);  // the rest only checked
  auto step = m->RestoreSlices(8, asked);
  REQUIRE_MESSAGE(step.ok(), step.status().ToString());
  for (size_t i = 0; i < of1.size(); ++i) CHECK(expect(ts[1].bytes, of1[i].first, of1[i].second, got1[i]));
  CHECK(expect(ts[2].bytes, 4, 8, got2[0]));
  // A flipped byte near the start, in the middle and in the last row: each
  // found, in whichever window holds it.
  const std::string shard = dir / "checkpoint_8/shard-00001.safetensors";
  auto flip = [&](uint64_t at) { FlipByteAt(shard, 4096 + at, 0x20); };
  REQUIRE(fs::file_size(shard) >= 4096 + ts[1].bytes.size());
  for (uint64_t at : {uint64_t{5}, ts[1].bytes.size() / 2 + 3, ts[1].bytes.size() - 1}) {
    flip(at);
    auto bad = m->RestoreSlices(8, strips(ts[1].name, {{0, 4}}, &got1));
    CHECK(bad.status().code() == StatusCode::kCorruption);
    CHECK(bad.status().message().find(shard + ": tensor \"layer1/w\"") == 0);
    flip(at);
  }
  CHECK(m->RestoreSlices(8, strips(ts[1].name, {{0, 4}}, &got1)).ok());
  CHECK(expect(ts[1].bytes, 0, 4, got1[0]));
}

TEST_CASE("restore into a buffer of the wrong shape names the tensor and both shapes") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(3, 1, 400);
  auto refs = Refs(ts);
  REQUIRE(m->Save(3, refs)->Wait().ok());
  std::vector<std::byte> buf(ts[0].bytes.size());
  std::vector<MutableTensorRef> targets{{ts[0].name, DType::kF32, {4, 100}, buf.data()}};
  auto step = m->RestoreInto(3, targets);
  CHECK(step.status().code() == StatusCode::kInvalidArgument);
  CHECK(step.status().message() == "tensor \"layer0/w\": the buffer is F32[4, 100] but step 3 holds F32[100, 4]");
}

TEST_CASE("zero-size and scalar tensors round-trip") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  std::vector<OwnedTensor> ts{MakeTensor("empty", DType::kF32, {0}, 1), MakeTensor("empty2d", DType::kI64, {3, 0}, 1),
                              MakeTensor("scalar", DType::kF64, {}, 1), MakeTensor("byte", DType::kU8, {1}, 1)};
  auto refs = Refs(ts);
  refs[0].data = nullptr;  // a zero-byte tensor may have no buffer
  REQUIRE(m->Save(1, refs)->Wait().ok());
  auto r = m->Restore(1);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CheckEqual(*r, ts);
  CHECK(r->tensors[2].bytes.size() == 8);
}

TEST_CASE("a checkpoint with no tensors at all commits and restores") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  REQUIRE(m->Save(5, {}, R"({"empty": true})")->Wait().ok());
  auto r = m->Restore(5);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CHECK(r->tensors.empty());
}

TEST_CASE("borrow mode writes straight from the caller's buffers") {
  TempDir dir;
  Options o = SmallOptions();
  o.snapshot = SnapshotMode::kBorrow;
  auto m = OpenOrDie(dir.path(), o);
  auto ts = State(9, 3, 500'000);
  auto refs = Refs(ts);
  auto h = m->Save(9, refs);
  REQUIRE(h.ok());
  REQUIRE(h->Wait().ok());
  auto r = m->Restore(9);
  REQUIRE(r.ok());
  CheckEqual(*r, ts);
}

TEST_CASE("saving a step that exists fails unless overwrite is set") {
  TempDir dir;
  auto ts = State(1, 2, 1000);
  auto refs = Refs(ts);
  {
    auto m = OpenOrDie(dir.path(), SmallOptions());
    REQUIRE(m->Save(1, refs)->Wait().ok());
    auto again = m->Save(1, refs);
    CHECK(again.status().code() == StatusCode::kAlreadyExists);
    CHECK(again.status().message() ==
          "checkpoint step 1 already exists in " + dir.path() + " (set overwrite to replace it)");
  }
  Options o = SmallOptions();
  o.overwrite = true;
  auto m = OpenOrDie(dir.path(), o);
  auto ts2 = State(2, 2, 1000);  // different bytes, same step
  auto refs2 = Refs(ts2);
  REQUIRE(m->Save(1, refs2)->Wait().ok());
  auto r = m->Restore(1);
  REQUIRE(r.ok());
  CheckEqual(*r, ts2);
  CHECK(DirNames(dir.path()) == std::vector<std::string>{"checkpoint_1"});
}

TEST_CASE("bad tensors are refused with the tensor's name") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  std::vector<std::byte> b(16);
  std::vector<TensorRef> dup{{"a", DType::kF32, {4}, b.data()}, {"a", DType::kF32, {4}, b.data()}};
  auto r = m->Save(1, dup);
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK(r.status().message().find("\"a\"") != std::string::npos);
  std::vector<TensorRef> null_data{{"w", DType::kF32, {4}, nullptr}};
  CHECK(m->Save(1, null_data).status().message() == "tensor \"w\": data is null but it holds 16 bytes");
  std::vector<TensorRef> dotdot{{"../evil", DType::kF32, {4}, b.data()}};
  CHECK(m->Save(1, dotdot).status().code() == StatusCode::kInvalidArgument);
  CHECK(m->Save(1, {}, "[1, 2]").status().code() == StatusCode::kInvalidArgument);
  CHECK(m->AllSteps().empty());
}

TEST_CASE("a state 2.5x staging_memory is saved, written before Save returns, and the caller may then reuse it") {
  // Reported: flax's one-import swap raised ResourceExhausted for a state
  // over staging_memory; flax itself has no such limit.
  TempDir dir;
  Options o = SmallOptions();
  o.staging_memory = 2 << 20;
  auto m = OpenOrDie(dir.path(), o);
  auto ts = State(1, 5, 262'144);  // 5 x 1 MiB = 2.5 x staging_memory
  auto refs = Refs(ts);
  const std::vector<OwnedTensor> saved = ts;
  auto r = m->Save(1, refs);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  // Save returned: nothing reads the buffers any more, so scribbling on
  // them must not reach the checkpoint.
  CHECK(r->bytes_written() == r->timings().bytes);
  for (OwnedTensor& t : ts) std::fill(t.bytes.begin(), t.bytes.end(), std::byte{0xEE});
  REQUIRE(r->Wait().ok());
  auto restored = m->Restore(1);
  REQUIRE_MESSAGE(restored.ok(), restored.status().ToString());
  REQUIRE(restored->tensors.size() == saved.size());
  for (size_t i = 0; i < saved.size(); ++i) CHECK(restored->tensors[i].bytes == saved[i].bytes);
  REQUIRE(m->Verify(1).ok());
}

TEST_CASE("keep_alive is held until the shards are written with borrow, and dropped right after a copy") {
  TempDir dir;
  for (SnapshotMode mode : {SnapshotMode::kBorrow, SnapshotMode::kCopy}) {
    CAPTURE(static_cast<int>(mode));
    Options o = SmallOptions();
    o.snapshot = mode;
    auto m = OpenOrDie(dir / (mode == SnapshotMode::kBorrow ? "borrow" : "copy"), o);
    auto ts = State(1, 3, 100'000);
    auto refs = Refs(ts);
    auto owner = std::make_shared<int>(7);
    std::weak_ptr<int> watch = owner;
    auto h = m->Save(1, refs, "{}", std::move(owner));
    REQUIRE(h.ok());
    if (mode == SnapshotMode::kCopy) CHECK(watch.expired());  // the copy is taken: the buffers are free
    REQUIRE(h->Wait().ok());
    CHECK(watch.expired());  // written: released, not kept until the manager closes
  }
}


TEST_CASE("snapshot background: the copy runs off the caller's thread, and after WaitSnapshot the buffers are free") {
  TempDir dir;
  Options o = SmallOptions();
  o.snapshot = SnapshotMode::kBackground;
  auto m = OpenOrDie(dir.path(), o);
  auto ts = State(3);
  const auto expected = ts;
  auto refs = Refs(ts);
  auto owner = std::make_shared<int>(3);
  std::weak_ptr<int> watch = owner;
  std::atomic<std::thread::id> copied_on{};
  auto h = m->Save(3, refs, "{}", std::move(owner), std::nullopt, [&] {
    copied_on = std::this_thread::get_id();
    return Status::Ok();
  });
  REQUIRE(h.ok());
  REQUIRE(h->WaitSnapshot().ok());
  // The check ran once the copy was taken, on the snapshot thread; the
  // caller's buffers were let go then.
  CHECK(copied_on.load() != std::thread::id{});
  CHECK(copied_on.load() != std::this_thread::get_id());
  CHECK(watch.expired());
  for (auto& t : ts) std::fill(t.bytes.begin(), t.bytes.end(), std::byte{0xEE});
  REQUIRE(h->Wait().ok());
  auto r = m->Restore(3);
  REQUIRE(r.ok());
  CheckEqual(*r, expected);
}

TEST_CASE("snapshot background: WaitSnapshots covers every save admitted, each keeps the bytes of its own Save") {
  TempDir dir;
  Options o = SmallOptions();
  o.snapshot = SnapshotMode::kBackground;
  o.keep = 0;
  auto m = OpenOrDie(dir.path(), o);
  auto ts = State(10);
  auto refs = Refs(ts);
  std::vector<std::vector<OwnedTensor>> expected;
  for (int64_t step = 10; step < 14; ++step) {
    auto h = m->Save(step, refs);
    REQUIRE(h.ok());
    expected.push_back(ts);
    m->WaitSnapshots();  // then the trainer's optimizer step may change the state
    for (auto& t : ts) {
      for (auto& b : t.bytes) b = std::byte(uint8_t(b) + 1);
    }
  }
  REQUIRE(m->WaitUntilFinished().ok());
  for (int64_t step = 10; step < 14; ++step) {
    auto r = m->Restore(step);
    REQUIRE(r.ok());
    CheckEqual(*r, expected[step - 10]);
  }
}

TEST_CASE("a snapshot whose check fails is never committed: WaitSnapshot, Wait and the next Save say why") {
  TempDir dir;
  for (SnapshotMode mode : {SnapshotMode::kCopy, SnapshotMode::kBackground}) {
    CAPTURE(static_cast<int>(mode));
    Options o = SmallOptions();
    o.snapshot = mode;
    const fs::path root = dir / (mode == SnapshotMode::kCopy ? "copy" : "background");
    auto m = OpenOrDie(root, o);
    auto ts = State(1);
    auto refs = Refs(ts);
    REQUIRE(m->Save(1, refs).ok());
    REQUIRE(m->WaitUntilFinished().ok());
    auto h = m->Save(2, refs, "{}", nullptr, std::nullopt,
                     [] { return FailedPreconditionError("tensor \"w\" changed during its snapshot"); });
    REQUIRE(h.ok());
    Status snap = h->WaitSnapshot();
    CHECK(snap.code() == StatusCode::kFailedPrecondition);
    CHECK(snap.message().find("tensor \"w\" changed") != std::string::npos);
    Status done = h->Wait();
    CHECK(!done.ok());
    CHECK(done.message().find("tensor \"w\" changed") != std::string::npos);
    CHECK(!fs::exists(root / "checkpoint_2"));
    auto next = m->Save(3, refs);  // reports the failure once, then saves again
    REQUIRE(!next.ok());
    CHECK(next.status().message().find("changed during its snapshot") != std::string::npos);
    REQUIRE(m->Save(3, refs).ok());
    REQUIRE(m->WaitUntilFinished().ok());
    CHECK(m->AllSteps() == std::vector<int64_t>{1, 3});
    auto r = m->Restore(1);
    REQUIRE(r.ok());
    CheckEqual(*r, ts);
  }
}
TEST_CASE("overlapping saves with keep=2 and keep_every=5 leave exactly the right steps") {
  TempDir dir;
  Options o = SmallOptions();
  o.keep = 2;
  o.keep_every = 5;
  o.max_in_flight = 3;
  auto m = OpenOrDie(dir.path(), o);
  std::vector<SaveHandle> handles;
  for (int64_t step = 1; step <= 12; ++step) {
    auto ts = State(step, 4, 200'000);
    auto refs = Refs(ts);
    auto h = m->Save(step, refs);  // issued faster than the disk persists them
    REQUIRE_MESSAGE(h.ok(), h.status().ToString());
    handles.push_back(*h);
  }
  REQUIRE(m->WaitUntilFinished().ok());
  for (auto& h : handles) CHECK(h.Wait().ok());
  CHECK(m->AllSteps() == std::vector<int64_t>{5, 10, 11, 12});
  // .recycle: the shard files of a pruned checkpoint, for the next save.
  CHECK(DirNames(dir.path()) ==
        std::vector<std::string>{".recycle", "checkpoint_10", "checkpoint_11", "checkpoint_12", "checkpoint_5"});
  for (int64_t step : {5, 10, 11, 12}) {
    auto r = m->Restore(step);
    REQUIRE(r.ok());
    CheckEqual(*r, State(step, 4, 200'000));
  }
}

TEST_CASE("with on_busy wait, a save that does not fit waits until staging has room, then commits") {
  TempDir dir;
  Options o = SmallOptions();
  o.staging_memory = 6 << 20;  // room for one 4.8 MB save at a time
  HeldManager h(dir.path(), o);
  auto first_state = State(1, 4, 300'000), second_state = State(2, 4, 300'000);
  auto first_refs = Refs(first_state), second_refs = Refs(second_state);
  auto first = h.manager->Save(1, first_refs);
  REQUIRE(first.ok());
  h.held.WaitUntilHeld();  // save 1 keeps its staging until released
  std::atomic<pid_t> saver_tid{0};
  std::atomic<bool> returned{false};
  std::optional<Result<SaveHandle>> second;
  std::thread saver([&] {
    saver_tid = gettid();
    second = h.manager->Save(2, second_refs);
    returned = true;
  });
  // Save 2 cannot have room before save 1's write goes on: it must block
  // (or, wrongly, return). Either shows soon; nothing here is timed.
  while (saver_tid == 0 || (!returned && !SleepsInFutex(saver_tid))) std::this_thread::yield();
  CHECK_FALSE(returned);
  h.held.Release();
  saver.join();
  REQUIRE(second->ok());
  CHECK_FALSE((*second)->skipped());
  CHECK((*second)->Wait().ok());
  CHECK(first->Wait().ok());
  CHECK(h.manager->AllSteps() == std::vector<int64_t>{1, 2});
  CHECK(h.manager->stats().saves_skipped == 0);
}

TEST_CASE("with on_busy skip, a save that does not fit is dropped and reported") {
  TempDir dir;
  Options o = SmallOptions();
  o.staging_memory = 6 << 20;  // room for one 4.8 MB save at a time
  o.on_busy = OnBusy::kSkip;
  HeldManager h(dir.path(), o);
  auto state = State(1, 4, 300'000);
  auto refs = Refs(state);
  auto first = h.manager->Save(1, refs);
  REQUIRE(first.ok());
  h.held.WaitUntilHeld();  // save 1 keeps its staging until released
  auto second = h.manager->Save(2, refs);
  h.held.Release();
  REQUIRE(second.ok());
  CHECK(second->skipped());
  CHECK(second->Wait().code() == StatusCode::kResourceExhausted);
  CHECK(second->Wait().message() == "save of step 2 skipped: not enough free staging memory for 4.59 MiB");
  CHECK(first->Wait().ok());
  REQUIRE(h.manager->WaitUntilFinished().ok());
  CHECK(h.manager->AllSteps() == std::vector<int64_t>{1});
  CHECK(h.manager->stats().saves_skipped == 1);
}

TEST_CASE("max_in_flight=1 with on_busy skip skips while a save is in flight") {
  TempDir dir;
  Options o = SmallOptions();
  o.max_in_flight = 1;
  o.on_busy = OnBusy::kSkip;
  HeldManager h(dir.path(), o);
  auto state = State(1, 2, 100'000);
  auto refs = Refs(state);
  auto first = h.manager->Save(1, refs);
  REQUIRE(first.ok());
  h.held.WaitUntilHeld();  // save 1 stays in flight until released
  auto second = h.manager->Save(2, refs);
  h.held.Release();
  REQUIRE(second.ok());
  CHECK(second->skipped());
  CHECK(second->Wait().message() == "save of step 2 skipped: 1 saves already in flight (max_in_flight)");
  REQUIRE(h.manager->WaitUntilFinished().ok());
  CHECK(h.manager->AllSteps() == std::vector<int64_t>{1});
  CHECK(h.manager->stats().saves_skipped == 1);
  CHECK(h.manager->stats().saves_committed == 1);
}

TEST_CASE("a flipped byte makes verify fail naming the shard and the tensor") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(4, 3, 100'000);
  auto refs = Refs(ts);
  REQUIRE(m->Save(4, refs)->Wait().ok());
  auto ok = m->Verify(4);
  REQUIRE_MESSAGE(ok.ok(), ok.status().ToString());
  CHECK(ok->tensors == 3);
  // Flip one byte inside the second tensor's data.
  const std::string shard = dir / "checkpoint_4/shard-00000.safetensors";
  auto info = m->Info(4);
  REQUIRE(info.ok());
  {
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(4096 + 400'000 + 123);
    char c;
    f.read(&c, 1);
    c ^= 0x01;
    f.seekp(4096 + 400'000 + 123);
    f.write(&c, 1);
  }
  auto bad = m->Verify(4);
  CHECK(bad.status().code() == StatusCode::kCorruption);
  CHECK(bad.status().message().find(shard + ": tensor \"layer1/w\"") == 0);
  CHECK(bad.status().message().find("CRC32C mismatch") != std::string::npos);
  CHECK(m->Restore(4).status().code() == StatusCode::kCorruption);
}

TEST_CASE("a truncated shard fails restore with the shard's path and sizes") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(4, 2, 1000);
  auto refs = Refs(ts);
  REQUIRE(m->Save(4, refs)->Wait().ok());
  const std::string shard = dir / "checkpoint_4/shard-00000.safetensors";
  uint64_t size = fs::file_size(shard);
  fs::resize_file(shard, size - 100);
  auto r = m->Restore(4);
  CHECK(r.status().code() == StatusCode::kCorruption);
  CHECK(r.status().message() == shard + ": " + std::to_string(size - 100) + " bytes, but the manifest says " +
                                    std::to_string(size) + " (truncated)");
}

TEST_CASE("a hostile manifest naming a shard outside the checkpoint is refused") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(4, 1, 1000);
  auto refs = Refs(ts);
  REQUIRE(m->Save(4, refs)->Wait().ok());
  const std::string manifest = dir / "checkpoint_4/manifest.json";
  std::string text = testing::ReadWholeFile(manifest);
  size_t pos;
  while ((pos = text.find("shard-00000.safetensors")) != std::string::npos) text.replace(pos, 23, "../../etc/passwd");
  testing::WriteWholeFile(manifest, text);
  auto r = m->Restore(4);
  CHECK(r.status().code() == StatusCode::kCorruption);
  CHECK(r.status().message().find(manifest) == 0);
  CHECK(r.status().message().find("../../etc/passwd") != std::string::npos);
}

TEST_CASE("a second writer on the same root is refused, naming the lock") {
  TempDir dir;
  auto writer = OpenOrDie(dir.path(), SmallOptions());
  auto second = CheckpointManager::Open(dir.path(), SmallOptions());
  CHECK(second.status().code() == StatusCode::kFailedPrecondition);
  CHECK(second.status().message() == "another process is writing checkpoints to " + dir.path() +
                                         " (it holds the lock " + dir.path() + "/.ckptio.lock)");
}

TEST_CASE("a read-only manager reads while a writer writes, and sees new commits after Refresh") {
  TempDir dir;
  auto writer = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(1, 1, 1000);
  auto refs = Refs(ts);
  REQUIRE(writer->Save(1, refs)->Wait().ok());
  auto reader = CheckpointManager::OpenReadOnly(dir.path(), SmallOptions());
  REQUIRE_MESSAGE(reader.ok(), reader.status().ToString());
  CHECK((*reader)->AllSteps() == std::vector<int64_t>{1});
  CHECK((*reader)->Restore(1).ok());
  auto s = (*reader)->Save(2, refs);
  CHECK(s.status().code() == StatusCode::kFailedPrecondition);
  CHECK(s.status().message() == "cannot save step 2: " + dir.path() + " was opened read-only");
  REQUIRE(writer->Save(2, refs)->Wait().ok());
  CHECK((*reader)->AllSteps() == std::vector<int64_t>{1});
  REQUIRE((*reader)->Refresh().ok());
  CHECK((*reader)->AllSteps() == std::vector<int64_t>{1, 2});
}

TEST_CASE("opening a missing root read-only fails and does not create it") {
  TempDir dir;
  auto reader = CheckpointManager::OpenReadOnly(dir / "missing", SmallOptions());
  CHECK(reader.status().code() == StatusCode::kNotFound);
  CHECK(reader.status().message() == "checkpoint root " + (dir / "missing") + " does not exist");
  CHECK_FALSE(fs::exists(dir / "missing"));
}

TEST_CASE("opening removes the debris of saves that never committed") {
  TempDir dir;
  fs::create_directories(dir / "checkpoint_7.tmp-0123456789abcdef");
  testing::WriteWholeFile(dir / "checkpoint_7.tmp-0123456789abcdef/shard-00000.safetensors", "partial");
  fs::create_directories(dir / "unrelated");
  auto m = OpenOrDie(dir.path(), SmallOptions());
  CHECK(DirNames(dir.path()) == std::vector<std::string>{"unrelated"});
  CHECK(m->AllSteps().empty());
}

TEST_CASE("delete removes a committed step and prune applies the keep policy") {
  TempDir dir;
  Options o = SmallOptions();
  auto m = OpenOrDie(dir.path(), o);
  auto ts = State(1, 1, 1000);
  auto refs = Refs(ts);
  for (int64_t step : {10, 20, 30, 40}) REQUIRE(m->Save(step, refs)->Wait().ok());
  REQUIRE(m->Delete(20).ok());
  CHECK(m->AllSteps() == std::vector<int64_t>{10, 30, 40});
  CHECK_FALSE(fs::exists(dir / "checkpoint_20"));
  CHECK(m->Delete(20).code() == StatusCode::kNotFound);
  m.reset();
  o.keep = 1;
  m = OpenOrDie(dir.path(), o);
  REQUIRE(m->Prune().ok());
  CHECK(m->AllSteps() == std::vector<int64_t>{40});
  CHECK(DirNames(dir.path()) == std::vector<std::string>{".recycle", "checkpoint_40"});
  // The bin keeps one pruned checkpoint's shard (step 10's); step 30's was
  // deleted, as was step 20's by Delete.
  CHECK(std::distance(fs::directory_iterator(dir / ".recycle"), fs::directory_iterator()) == 1);
}

TEST_CASE("restoring from an empty root says there is no checkpoint") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  CHECK(m->Restore().status().code() == StatusCode::kNotFound);
  CHECK(m->Restore().status().message() == "no committed checkpoint in " + dir.path());
  CHECK(m->LatestStep() == std::nullopt);
}

// ---- Chunks of arrays -------------------------------------------------------

// A chunk of array "w" (F32, global shape [64, 8]) at `start`: its bytes are
// a function of its canonical name; its TensorRef leaves the name empty for
// the planner to fill in.
struct WChunk {
  OwnedTensor tensor;  // named ChunkName("w", start)
  std::vector<uint64_t> start;
  TensorRef ref() const { return {"", tensor.dtype, tensor.shape, tensor.bytes.data(), {"w", {64, 8}, start}}; }
};

WChunk MakeWChunk(std::vector<uint64_t> start, std::vector<uint64_t> shape, int64_t step) {
  return {MakeTensor(ChunkName("w", start), DType::kF32, std::move(shape), step), std::move(start)};
}

std::vector<TensorRef> ChunkRefs(const std::vector<WChunk>& chunks) {
  std::vector<TensorRef> refs;
  for (const WChunk& c : chunks) refs.push_back(c.ref());
  return refs;
}

// Every file and directory under `root`, relative to it, sorted.
std::vector<std::string> AllEntries(const std::string& root) {
  std::vector<std::string> names;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    names.push_back(fs::relative(e.path(), root).string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST_CASE("chunks of an array saved without names commit under their canonical names and restore exactly") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  // Rows 0-16 whole, rows 16-64 split by columns at 4; and a whole tensor.
  const std::vector<WChunk> w = {MakeWChunk({0, 0}, {16, 8}, 1), MakeWChunk({16, 0}, {48, 4}, 1),
                                 MakeWChunk({16, 4}, {48, 4}, 1)};
  const OwnedTensor step = MakeTensor("step", DType::kI64, {}, 1);
  std::vector<TensorRef> refs = ChunkRefs(w);
  refs.push_back(step.ref());
  auto h = m->Save(1, refs);
  REQUIRE_MESSAGE(h.ok(), h.status().ToString());
  const Status s = h->Wait();
  REQUIRE_MESSAGE(s.ok(), s.ToString());

  auto info = m->Info(1);
  REQUIRE_MESSAGE(info.ok(), info.status().ToString());
  REQUIRE(info->tensor_list.size() == 4);
  const std::vector<std::string> names = {"w@0,0", "w@16,0", "w@16,4"};
  for (size_t i = 0; i < 3; ++i) {
    CAPTURE(i);
    const TensorInfo& t = info->tensor_list[i];
    CHECK(t.name == names[i]);
    CHECK(t.dtype == DType::kF32);
    CHECK(t.shape == w[i].tensor.shape);
    CHECK(t.bytes == w[i].tensor.bytes.size());
    CHECK(t.chunk.array == "w");
    CHECK(t.chunk.global_shape == std::vector<uint64_t>{64, 8});
    CHECK(t.chunk.start == w[i].start);
  }
  CHECK(info->tensor_list[3].name == "step");
  CHECK(info->tensor_list[3].bytes == 8);
  CHECK(info->tensor_list[3].chunk.empty());
  CHECK(nlohmann::json::parse(testing::ReadWholeFile(dir / "checkpoint_1/manifest.json"))["format_version"] == 2);

  auto r = m->Restore(1);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CheckEqual(*r, {w[0].tensor, w[1].tensor, w[2].tensor, step});

  // Bytes 100-400 of the chunk at rows 16-64, columns 4-8.
  Bytes part(300);
  std::vector<TensorSlice> slice = {{"w@16,4", 100, part.size(), part.data()}};
  auto read = m->RestoreSlices(1, slice);
  REQUIRE_MESSAGE(read.ok(), read.status().ToString());
  CHECK(std::equal(part.begin(), part.end(), w[2].tensor.bytes.begin() + 100));
}

TEST_CASE("a save of whole tensors only still writes format version 1") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  auto ts = State(1, 1, 1000);
  auto refs = Refs(ts);
  REQUIRE(m->Save(1, refs)->Wait().ok());
  CHECK(nlohmann::json::parse(testing::ReadWholeFile(dir / "checkpoint_1/manifest.json"))["format_version"] == 1);
  auto info = m->Info(1);
  REQUIRE(info.ok());
  REQUIRE(info->tensor_list.size() == 1);
  CHECK(info->tensor_list[0].chunk.empty());
}

TEST_CASE("a save whose chunks leave a gap, overlap or are misnamed fails at Save, naming them, and writes nothing") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  const std::vector<std::string> before = AllEntries(dir.path());

  const std::vector<WChunk> gap = {MakeWChunk({0, 0}, {16, 8}, 1), MakeWChunk({16, 0}, {48, 4}, 1)};
  auto r = m->Save(1, ChunkRefs(gap));
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK(r.status().message() == "save: the chunks of array \"w\" cover 320 of the 512 elements of its global shape "
                                "[64, 8]: a chunk is missing");

  const std::vector<WChunk> overlap = {MakeWChunk({0, 0}, {40, 8}, 1), MakeWChunk({32, 0}, {32, 8}, 1)};
  r = m->Save(1, ChunkRefs(overlap));
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK(r.status().message() == "save: chunks \"w@0,0\" [0:40, 0:8] and \"w@32,0\" [32:64, 0:8] of array \"w\" "
                                "overlap");

  const std::vector<WChunk> whole = {MakeWChunk({0, 0}, {64, 8}, 1)};
  std::vector<TensorRef> misnamed = ChunkRefs(whole);
  misnamed[0].name = "w";
  r = m->Save(1, misnamed);
  CHECK(r.status().code() == StatusCode::kInvalidArgument);
  CHECK(r.status().message() == "save: tensor \"w\": the chunk of array \"w\" at [0, 0] must be named \"w@0,0\"");

  CHECK(AllEntries(dir.path()) == before);
  CHECK(m->AllSteps().empty());
  // The manager is none the worse: the whole array in one chunk commits.
  REQUIRE(m->Save(1, ChunkRefs(whole))->Wait().ok());
  CHECK(m->AllSteps() == std::vector<int64_t>{1});
}

}  // namespace
}  // namespace ckptio

namespace ckptio {
namespace {

TEST_CASE("with trace.path set, the manager writes a trace-event file with a span per stage") {
  TempDir dir;
  Options o = SmallOptions();
  o.trace.path = dir / "trace.json";
  {
    auto m = OpenOrDie(dir / "ckpt", o);
    auto ts = State(1, 3, 300'000);
    auto refs = Refs(ts);
    REQUIRE(m->Save(1, refs)->Wait().ok());
    REQUIRE(m->Restore(1).ok());
  }
  auto j = nlohmann::json::parse(testing::ReadWholeFile(dir / "trace.json"));
  std::map<std::string, int> by_track;  // thread name -> spans
  std::map<int, std::string> names;
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "thread_name") names[e["tid"].get<int>()] = e["args"]["name"];
  }
  for (const auto& e : j["traceEvents"]) {
    if (e["ph"] == "X") {
      by_track[names[e["tid"].get<int>()]]++;
      CHECK(e["dur"].get<int64_t>() >= 0);
    }
  }
  CHECK(by_track["trainer (Save blocked)"] == 1);
  CHECK(by_track["snapshot"] == 1);
  CHECK(by_track["write / upload"] >= 2);  // one span per shard file
  CHECK(by_track["CRC32C"] == 1);
  CHECK(by_track["commit"] == 1);
  CHECK(by_track["read"] == 1);
  CHECK(by_track["io_uring batches"] > 0);
}

TEST_CASE("without trace.path no trace file is written") {
  TempDir dir;
  {
    auto m = OpenOrDie(dir / "ckpt", SmallOptions());
    auto ts = State(1, 1, 1000);
    auto refs = Refs(ts);
    REQUIRE(m->Save(1, refs)->Wait().ok());
  }
  for (const auto& e : fs::directory_iterator(dir.path())) CHECK(e.path().filename() == "ckpt");
}

TEST_CASE("ReadInOrder hands every tensor byte over once, in saved order, through windows smaller than a tensor") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  std::vector<OwnedTensor> ts = {MakeTensor("big", DType::kU8, {3 << 20}, 1), MakeTensor("one", DType::kU8, {1}, 1),
                                 MakeTensor("none", DType::kF32, {0, 4}, 1), MakeTensor("mid", DType::kF32, {300'001}, 1)};
  auto refs = Refs(ts);
  REQUIRE(m->Save(1, refs, R"({"k": "v"})")->Wait().ok());
  std::vector<TensorInfo> infos;
  std::vector<Bytes> got(ts.size());
  size_t largest_piece = 0;
  std::vector<size_t> order;
  OrderedReader reader;
  reader.begin = [&](int64_t step, const std::string& metadata, const std::vector<TensorInfo>& tensors) {
    CHECK(step == 1);
    CHECK(metadata == R"({"k":"v"})");
    infos = tensors;
    return Status::Ok();
  };
  reader.piece = [&](size_t t, uint64_t offset, std::span<const std::byte> bytes) {
    CHECK(offset == got[t].size());  // consecutive within the tensor
    if (order.empty() || order.back() != t) order.push_back(t);
    got[t].insert(got[t].end(), bytes.begin(), bytes.end());
    largest_piece = std::max(largest_piece, bytes.size());
    return Status::Ok();
  };
  auto step = m->ReadInOrder(std::nullopt, reader, 1 << 20);
  REQUIRE_MESSAGE(step.ok(), step.status().ToString());
  CHECK(*step == 1);
  REQUIRE(infos.size() == ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    CHECK(infos[i].name == ts[i].name);
    CHECK(infos[i].shape == ts[i].shape);
    CHECK(infos[i].bytes == ts[i].bytes.size());
    CHECK(got[i] == ts[i].bytes);
  }
  CHECK(order == std::vector<size_t>{0, 1, 3});  // saved order; the empty tensor has no piece
  CHECK(largest_piece <= (1u << 20));
}

TEST_CASE("ReadInOrder checks a tensor's CRC32C before handing over its last piece") {
  TempDir dir;
  auto m = OpenOrDie(dir.path(), SmallOptions());
  std::vector<OwnedTensor> ts = {MakeTensor("w", DType::kU8, {3 << 20}, 2)};
  auto refs = Refs(ts);
  REQUIRE(m->Save(2, refs)->Wait().ok());
  {  // flip the tensor's last byte on disk
    std::fstream f(dir / "checkpoint_2/shard-00000.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const auto end = f.tellg();
    f.seekg(end - std::streamoff(1));
    char c = static_cast<char>(f.get());
    f.seekp(end - std::streamoff(1));
    f.put(static_cast<char>(~c));
  }
  uint64_t handed = 0;
  OrderedReader reader;
  reader.piece = [&](size_t, uint64_t, std::span<const std::byte> bytes) {
    handed += bytes.size();
    return Status::Ok();
  };
  auto step = m->ReadInOrder(2, reader, 1 << 20);
  CHECK(step.status().code() == StatusCode::kCorruption);
  CHECK(step.status().message().find("CRC32C mismatch") != std::string::npos);
  CHECK(handed < ts[0].bytes.size());  // the piece with the bad byte never went out
}


TEST_CASE("two tiers: steps go to the remote directory, and a new local tier is seeded from it") {
  TempDir dir;
  Options o = SmallOptions();
  o.tiers.remote = dir.path() + "/remote";
  o.tiers.remote_keep = 2;
  auto ts = State(3, 4, 300'000);  // several shards
  {
    auto m = OpenOrDie(dir.path() + "/a", o);
    for (int64_t step : {1, 2, 3}) {
      auto refs = Refs(ts);
      REQUIRE(m->Save(step, refs)->Wait().ok());
    }
    REQUIRE(m->WaitUntilFinished(CheckpointManager::Tier::kRemote).ok());
    CHECK(m->stats().steps_replicated == 3);
    CHECK(m->AllSteps(CheckpointManager::Tier::kRemote) == std::vector<int64_t>{2, 3});
  }
  o.tiers.seed_local = true;
  {
    auto m = OpenOrDie(dir.path() + "/b", o);
    Status waited = m->WaitUntilFinished(CheckpointManager::Tier::kRemote);
    REQUIRE_MESSAGE(waited.ok(), waited.ToString());
    CHECK(m->stats().steps_seeded == 1);
    CHECK(m->AllSteps(CheckpointManager::Tier::kLocal) == std::vector<int64_t>{3});
  }
  // The seeded step alone, without the remote tier, restores and verifies.
  auto local = OpenOrDie(dir.path() + "/b", SmallOptions());
  auto r = local->Restore();
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  CHECK(r->step == 3);
  CheckEqual(*r, ts);
  CHECK(local->Verify(3).ok());
}


TEST_CASE("the replication journal resumes a session only for the same step, remote root and file bytes") {
  TempDir dir;
  const std::string uri = "http://127.0.0.1:9/upload/storage/v1/b/b/o?upload_id=1";
  auto j = pipeline::ReplicationJournal::Load(dir.path(), "gs://b/r", 7);
  CHECK(j.Session("shard-00000.safetensors", 10, 1).empty());
  REQUIRE(j.Record("shard-00000.safetensors", 10, 1, uri).ok());
  const std::string path = dir.path() + "/" + pipeline::ReplicationJournal::kFileName;
  struct stat st {};
  REQUIRE(::stat(path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);  // a session URI lets its holder upload
  auto again = pipeline::ReplicationJournal::Load(dir.path(), "gs://b/r", 7);
  CHECK(again.Session("shard-00000.safetensors", 10, 1) == uri);
  CHECK(again.Session("shard-00000.safetensors", 10, 2).empty());  // the step was saved again, other bytes
  CHECK(again.Session("shard-00000.safetensors", 11, 1).empty());
  CHECK(again.Session("shard-00001.safetensors", 10, 1).empty());
  CHECK(pipeline::ReplicationJournal::Load(dir.path(), "gs://b/r", 8).Session("shard-00000.safetensors", 10, 1).empty());
  CHECK(pipeline::ReplicationJournal::Load(dir.path(), "gs://b/x", 7).Session("shard-00000.safetensors", 10, 1).empty());
  REQUIRE(again.Clear().ok());
  CHECK(::access(path.c_str(), F_OK) != 0);
}

}  // namespace
}  // namespace ckptio
