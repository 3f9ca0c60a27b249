// Power loss, not only process death. LevelDB's fault-injection idea: a
// model of the disk records every change LocalStorage makes (through its
// test observer) and can rebuild what survives a power cut after any prefix
// of them: files as of their last fsync, directory entries as of their
// directory's last fsync, nothing else. After each simulated cut, recovery
// must find the previous or the new checkpoint, complete and verified, never
// a mix, and must never lose a checkpoint that was durably committed (beyond
// what `keep` prunes).

#include <doctest/doctest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "ckptio/checkpoint_manager.h"
#include "storage/local_storage.h"
#include "test_state.h"
#include "test_util.h"

namespace ckptio {
namespace {

namespace fs = std::filesystem;

class DiskModel final : public storage::FsObserver {
 public:
  explicit DiskModel(std::string root) : root_(std::move(root)) {}

  void MadeDir(const std::string& p) override { Add({Op::kMkdir, p, "", nullptr}); }
  void CreatedFile(const std::string& p) override { Add({Op::kCreate, p, "", nullptr}); }
  void Synced(const std::string& p) override {
    const std::string real = p.empty() ? root_ : root_ + "/" + p;
    std::shared_ptr<const std::string> data;
    if (fs::is_regular_file(real)) data = std::make_shared<const std::string>(testing::ReadWholeFile(real));
    Add({Op::kSync, p, "", std::move(data)});
  }
  void Renamed(const std::string& from, const std::string& to, bool exchange) override {
    Add({exchange ? Op::kExchange : Op::kRename, from, to, nullptr});
  }
  void Removed(const std::string& p) override { Add({Op::kRemove, p, "", nullptr}); }

  size_t ops() const {
    std::lock_guard lock(mu_);
    return log_.size();
  }

  // Writes into the empty directory `dir` what a power cut after the first
  // `k` changes leaves on disk.
  void Materialize(size_t k, const std::string& dir) const {
    std::lock_guard lock(mu_);
    Replay replay;
    for (size_t i = 0; i < k && i < log_.size(); ++i) replay.Apply(log_[i]);
    replay.Write(0, dir);
  }

 private:
  struct Op {
    enum Kind { kMkdir, kCreate, kSync, kRename, kExchange, kRemove } kind;
    std::string a, b;
    std::shared_ptr<const std::string> data;  // a file's bytes when it was synced
  };

  // Inodes, so that renaming a directory keeps what was synced inside it.
  struct Replay {
    struct Inode {
      bool dir = false;
      std::map<std::string, int> live, durable;
      std::shared_ptr<const std::string> data;  // synced bytes (null: never synced)
    };
    std::vector<Inode> inodes{Inode{true, {}, {}, nullptr}};  // 0: the root

    static std::pair<std::string, std::string> Split(const std::string& p) {
      size_t s = p.rfind('/');
      return s == std::string::npos ? std::make_pair(std::string(), p) : std::make_pair(p.substr(0, s), p.substr(s + 1));
    }
    int Resolve(const std::string& p) {
      int ino = 0;
      size_t start = 0;
      while (start < p.size()) {
        size_t end = p.find('/', start);
        if (end == std::string::npos) end = p.size();
        ino = inodes[ino].live.at(p.substr(start, end - start));
        start = end + 1;
      }
      return ino;
    }
    void Apply(const Op& op) {
      auto [parent, base] = Split(op.a);
      switch (op.kind) {
        case Op::kMkdir:
        case Op::kCreate:
          inodes.push_back(Inode{op.kind == Op::kMkdir, {}, {}, nullptr});
          inodes[Resolve(parent)].live[base] = static_cast<int>(inodes.size() - 1);
          break;
        case Op::kSync: {
          Inode& n = inodes[Resolve(op.a)];
          if (n.dir) {
            n.durable = n.live;
          } else {
            n.data = op.data;
          }
          break;
        }
        case Op::kRename: {
          auto [to_parent, to_base] = Split(op.b);
          int ino = inodes[Resolve(parent)].live.at(base);
          inodes[Resolve(parent)].live.erase(base);
          inodes[Resolve(to_parent)].live[to_base] = ino;
          break;
        }
        case Op::kExchange: {
          auto [to_parent, to_base] = Split(op.b);
          std::swap(inodes[Resolve(parent)].live.at(base), inodes[Resolve(to_parent)].live.at(to_base));
          break;
        }
        case Op::kRemove:
          inodes[Resolve(parent)].live.erase(base);
          break;
      }
    }
    void Write(int ino, const std::string& path) const {
      for (const auto& [name, child] : inodes[ino].durable) {
        const std::string p = path + "/" + name;
        if (inodes[child].dir) {
          fs::create_directory(p);
          Write(child, p);
        } else {
          // A file whose entry survived but whose data was never synced
          // comes back empty.
          testing::WriteWholeFile(p, inodes[child].data ? *inodes[child].data : std::string());
        }
      }
    }
  };

  void Add(Op op) {
    std::lock_guard lock(mu_);
    log_.push_back(std::move(op));
  }

  std::string root_;
  mutable std::mutex mu_;
  std::vector<Op> log_;
};

struct Workload {
  int keep = 2;
  int tensors = 3;
  uint64_t elems = 20'000;  // 80 KB per tensor
  uint64_t shard_size = 64 << 10;
  std::vector<std::pair<int64_t, bool>> saves;  // (step, overwrite)
  // Incremental saves: the first `frozen` tensors never change, so later
  // steps refer to the shards of the first.
  bool incremental = false;
  int frozen = 0;
};

// The content saved as (step, version): overwrites change a step's bytes.
std::vector<testing::OwnedTensor> Content(const Workload& w, int64_t step, int version) {
  auto state = testing::MakeState(step * 1000 + version, static_cast<size_t>(w.tensors), w.elems);
  auto frozen = testing::MakeState(-1, static_cast<size_t>(w.frozen), w.elems);
  for (int i = 0; i < w.frozen; ++i) state[static_cast<size_t>(i)] = std::move(frozen[static_cast<size_t>(i)]);
  return state;
}

struct Recording {
  std::unique_ptr<testing::TempDir> dir;
  std::unique_ptr<DiskModel> model;
  // The change count by which each (step, version) was durably committed.
  std::vector<std::tuple<size_t, int64_t, int>> commits;
};

Options OptionsFor(const Workload& w, bool overwrite) {
  Options o;
  o.staging_memory = 16 << 20;
  o.shard_size = w.shard_size;
  o.keep = w.keep;
  o.max_in_flight = 1;
  o.threads = 2;
  o.overwrite = overwrite;
  o.incremental = w.incremental;
  return o;
}

Recording Record(const Workload& w) {
  Recording rec;
  rec.dir = std::make_unique<testing::TempDir>();
  rec.model = std::make_unique<DiskModel>(rec.dir->path());
  storage::SetFsObserverForTesting(rec.model.get());
  std::map<int64_t, int> versions;
  for (auto [step, overwrite] : w.saves) {
    // A manager per save, so that `overwrite` can differ; reopening also
    // runs recovery between saves, as a restarted trainer would.
    auto m = CheckpointManager::Open(rec.dir->path(), OptionsFor(w, overwrite));
    REQUIRE_MESSAGE(m.ok(), m.status().ToString());
    int version = versions.count(step) ? versions[step] + 1 : 0;
    auto state = Content(w, step, version);
    auto refs = testing::Refs(state);
    auto h = (*m)->Save(step, refs);
    REQUIRE_MESSAGE(h.ok(), h.status().ToString());
    REQUIRE(h->Wait().ok());
    rec.commits.emplace_back(rec.model->ops(), step, version);
    versions[step] = version;
    REQUIRE((*m)->WaitUntilFinished().ok());  // prune done
  }
  storage::SetFsObserverForTesting(nullptr);
  return rec;
}

// The committed steps visible in a directory: checkpoint_N/manifest.json.
std::set<int64_t> VisibleSteps(const std::string& dir) {
  std::set<int64_t> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string n = e.path().filename().string();
    if (n.rfind("checkpoint_", 0) == 0 && n.find('.') == std::string::npos && fs::exists(e.path() / "manifest.json")) {
      out.insert(std::stoll(n.substr(11)));
    }
  }
  return out;
}

// Cuts power after `k` changes and checks what recovery makes of it.
void CheckCutAt(const Workload& w, const Recording& rec, size_t k) {
  CAPTURE(k);
  testing::TempDir disk;
  rec.model->Materialize(k, disk.path());
  const std::set<int64_t> visible = VisibleSteps(disk.path());
  auto m = CheckpointManager::Open(disk.path(), OptionsFor(w, false));
  REQUIRE_MESSAGE(m.ok(), m.status().ToString());
  std::vector<int64_t> steps = (*m)->AllSteps();
  // Recovery neither invents nor drops a checkpoint the disk holds...
  CHECK(std::set<int64_t>(steps.begin(), steps.end()) == visible);
  // ...leaves no debris...
  for (const auto& e : fs::directory_iterator(disk.path())) {
    CHECK_MESSAGE(e.path().filename().string().find(".tmp-") == std::string::npos, "debris " << e.path());
  }
  // ...and every checkpoint is complete: one whole version, never a mix.
  std::map<int64_t, int> latest_version;
  int64_t durable_max = -1;
  std::set<int64_t> durable;
  for (const auto& [at, step, version] : rec.commits) {
    if (at <= k) {
      latest_version[step] = version;
      durable.insert(step);
      durable_max = std::max(durable_max, step);
    }
  }
  for (int64_t step : steps) {
    auto r = (*m)->Restore(step);
    REQUIRE_MESSAGE(r.ok(), "step " << step << ": " << r.status().ToString());
    bool matches_a_version = false;
    for (int v = 0; v <= latest_version[step] + 1 && !matches_a_version; ++v) {
      auto want = Content(w, step, v);
      bool same = r->tensors.size() == want.size();
      for (size_t i = 0; same && i < want.size(); ++i) same = r->tensors[i].bytes == want[i].bytes;
      matches_a_version = same;
    }
    CHECK_MESSAGE(matches_a_version, "step " << step << " is torn");
  }
  // A durably committed checkpoint is never lost, beyond what keep prunes.
  if (durable_max >= 0) {
    REQUIRE_FALSE(steps.empty());
    CHECK(steps.back() >= durable_max);
    CHECK(steps.size() >= std::min<size_t>(durable.size(), static_cast<size_t>(w.keep)));
  }
}

TEST_CASE("a power cut at every point of saves, an overwrite and prunes leaves a complete checkpoint") {
  Workload w;
  w.saves = {{1, false}, {2, false}, {3, false}, {3, true}, {4, false}};
  Recording rec = Record(w);
  const size_t n = rec.model->ops();
  MESSAGE(n << " changes recorded; cutting power after each");
  REQUIRE(n > 40);
  for (size_t k = 0; k <= n; ++k) CheckCutAt(w, rec, k);
}

TEST_CASE("a power cut at every point of incremental saves and prunes loses no file a kept step refers to") {
  Workload w;
  w.incremental = true;
  w.tensors = 4;
  w.frozen = 2;  // two of four tensors, in shards of their own, never change
  w.elems = 16'000;
  w.shard_size = 64 << 10;
  w.saves = {{1, false}, {2, false}, {3, false}, {4, false}, {5, false}};
  Recording rec = Record(w);
  const size_t n = rec.model->ops();
  MESSAGE(n << " changes recorded; cutting power after each");
  REQUIRE(n > 40);
  for (size_t k = 0; k <= n; ++k) CheckCutAt(w, rec, k);
  // What the sweep covered: step 1 retired (pruned, its frozen shards kept).
  testing::TempDir disk;
  rec.model->Materialize(n, disk.path());
  CHECK(VisibleSteps(disk.path()) == std::set<int64_t>{4, 5});
  CHECK(fs::exists(disk.path() + "/checkpoint_1/shard-00000.safetensors"));
  CHECK_FALSE(fs::exists(disk.path() + "/checkpoint_1/manifest.json"));
}

// CKPTIO_POWER_CUTS sets the number of cuts (make test: 400, with the
// exhaustive cases above; a soak: any number).
TEST_CASE("a randomized sweep of power cuts over random workloads") {
  const unsigned seed = std::random_device{}();
  const char* cuts_env = std::getenv("CKPTIO_POWER_CUTS");
  const int total = cuts_env != nullptr ? std::atoi(cuts_env) : 400;
  MESSAGE("seed " << seed << ", " << total << " cuts");
  std::mt19937 rng(seed);
  int cuts = 0;
  while (cuts < total) {
    Workload w;
    w.keep = 1 + static_cast<int>(rng() % 3);
    w.tensors = 1 + static_cast<int>(rng() % 5);
    w.elems = 1000 + rng() % 40'000;
    w.shard_size = (16 + rng() % 128) << 10;
    int64_t step = 0;
    for (int i = 0, saves = 2 + static_cast<int>(rng() % 4); i < saves; ++i) {
      bool overwrite = step > 0 && rng() % 5 == 0;
      if (!overwrite) step += 1 + static_cast<int64_t>(rng() % 3);
      w.saves.push_back({step, overwrite});
    }
    Recording rec = Record(w);
    const size_t n = rec.model->ops();
    for (int i = 0; i < 50 && cuts < total; ++i, ++cuts) CheckCutAt(w, rec, rng() % (n + 1));
  }
  CHECK(cuts == total);
}

}  // namespace
}  // namespace ckptio
