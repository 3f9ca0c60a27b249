// bench/micro: throughput per core of each stage of a save, each against the
// machine's limit for that stage measured in the same run.
//
//   micro [--dir DIR] [--size-mib N] [--rounds R] [--skip-fio]
//         [--upload-gib G] [--skip-upload]
//
// Rows, all through the code a save runs:
//   CRC32C            format::Crc32c (ISA-L) over the state, one thread
//   snapshot copy     pipeline::CopySnapshot as Save() takes it (the caller
//                     plus one pool worker per other core), CRC in the
//                     background (the default) or fused into the copy
//   serialize         PlanSave (safetensors headers + shard plan), the
//                     per-tensor and per-shard CRC combination, the manifest
//   local write       LocalStorage: O_DIRECT writes of the staged shard
//                     images, fdatasync, manifest, renames, fsyncs
//   HTTP/HTTPS upload bench/upload_bench (GcsClient::Upload against curl -T
//                     to the same sink), one connection
// Each row: GB/s of wall time, CPU-seconds per GiB (the whole process, user +
// system, io_uring workers included), GB per CPU-second ("per core"), and
// the ratio to its limit: memcpy into warm memory on as many threads, fio
// O_DIRECT sequential write of the same bytes, curl. Ratios > 1: faster
// than the limit (a CRC only reads, where memcpy reads and writes).

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/status_macros.h"
#include "bench_util.h"
#include "ckptio/options.h"
#include "runtime/task.h"
#include "runtime/when_all.h"
#include "format/crc32c.h"
#include "format/manifest.h"
#include "pipeline/save_plan.h"
#include "pipeline/snapshot.h"
#include "runtime/cpu_pool.h"
#include "runtime/loop.h"
#include "runtime/trace.h"
#include "storage/local_storage.h"

namespace ckptio::bench {
namespace {

constexpr size_t kCopyChunk = size_t{1} << 20;  // as the manager's snapshot
constexpr size_t kCrcChunk = size_t{8} << 20;   // as the manager's background CRC pass
constexpr double kGiB = double(uint64_t{1} << 30);

struct Args {
  std::string dir = "bench/results/tmp";
  size_t size_mib = 512;
  int rounds = 5;
  bool fio = true;
  double upload_gib = 0.25;
  bool upload = true;
};

[[noreturn]] void Usage(int code) {
  std::fprintf(code == 0 ? stdout : stderr,
               "usage: micro [--dir DIR] [--size-mib N] [--rounds R] [--skip-fio] [--upload-gib G] "
               "[--skip-upload]\n");
  std::exit(code);
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto next = [&] { return FlagValue("micro", argc, argv, &i); };
    try {
      if (s == "--dir") a.dir = next();
      else if (s == "--size-mib") a.size_mib = std::stoul(next());
      else if (s == "--rounds") a.rounds = std::max(1, std::stoi(next()));
      else if (s == "--skip-fio") a.fio = false;
      else if (s == "--upload-gib") a.upload_gib = std::stod(next());
      else if (s == "--skip-upload") a.upload = false;
      else Usage(s == "--help" ? 0 : 1);
    } catch (const std::exception&) {
      std::fprintf(stderr, "micro: bad value for %s: %s\n", s.c_str(), argv[i]);
      std::exit(1);
    }
  }
  if (a.size_mib < 16) {
    std::fprintf(stderr, "micro: --size-mib must be at least 16, got %zu\n", a.size_mib);
    std::exit(1);
  }
  return a;
}

void Check(const Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "micro: %s: %s\n", what, s.ToString().c_str());
    std::exit(2);
  }
}

Rate Median(std::vector<Rate> v) {
  std::sort(v.begin(), v.end(), [](const Rate& a, const Rate& b) { return a.gbps() < b.gbps(); });
  return v[v.size() / 2];
}

// Runs fn `rounds` times over `bytes` bytes; the median round by throughput.
template <typename F>
Rate Measure(int rounds, double bytes, F&& fn) {
  std::vector<Rate> v;
  for (int r = 0; r < rounds; ++r) {
    Phase p;
    fn();
    v.push_back({p.wall(), p.cpu(), bytes});
  }
  return Median(v);
}

// ~100 tensors of mixed dtypes and sizes in one warm allocation, like the
// demo's state (sizes 0.5x..1.5x of the mean, 4 KiB multiples).
struct State {
  AlignedBuffer buf;
  size_t bytes = 0;
  std::vector<TensorRef> tensors;
};

State MakeState(size_t bytes) {
  State s{WarmBuffer(bytes, 11), bytes, {}};
  const DType dtypes[] = {DType::kBF16, DType::kF32, DType::kF16, DType::kF32};
  const size_t n = 100, mean = bytes / n;
  size_t off = 0;
  for (size_t i = 0; i < n && off < bytes; ++i) {
    size_t want = (i + 1 == n) ? bytes - off : std::min(bytes - off, (mean / 2 + (mean * (i % 11)) / 10) & ~size_t{4095});
    const DType dt = dtypes[i % 4];
    const size_t elem = (dt == DType::kF32) ? 4 : 2;
    s.tensors.push_back({"layers/" + std::to_string(i) + "/kernel", dt, {want / elem}, s.buf.get() + off});
    off += want;
  }
  return s;
}

// memcpy of `bytes` into warm memory, split across `threads` threads.
void ParallelMemcpy(char* dst, const char* src, size_t bytes, size_t threads) {
  std::vector<std::thread> ts;
  const size_t part = (bytes / threads) & ~size_t{4095};
  for (size_t t = 1; t < threads; ++t) {
    const size_t off = t * part, len = (t + 1 == threads) ? bytes - off : part;
    ts.emplace_back([=] { std::memcpy(dst + off, src + off, len); });
  }
  std::memcpy(dst, src, threads == 1 ? bytes : part);
  for (auto& t : ts) t.join();
}

struct Row {
  std::string stage;
  std::string threads;
  Rate rate;
  std::string limit_name;
  Rate limit;  // bytes == 0: none
};

double PerCore(const Rate& r) { return r.cpu > 0 ? r.bytes / r.cpu / 1e9 : 0; }

std::string Cell(const char* f, double v) { return v > 0 ? Fmt(f, v) : "-"; }

// Two ratios: of wall-time throughput (what a busy shared machine disturbs
// most) and of bytes per CPU-second (what the code costs, steadier).
void AddRow(Table& t, const Row& r) {
  const bool limited = r.limit.bytes > 0 && r.limit.seconds > 0;
  const double per_core = PerCore(r.rate), limit_per_core = limited ? PerCore(r.limit) : 0;
  t.Add({r.stage, r.threads, Fmt("%.2f", r.rate.gbps()), Fmt("%.3f", r.rate.cpu_per_gib()), Cell("%.2f", per_core),
         r.limit_name, limited ? Fmt("%.2f", r.limit.gbps()) : "-", limited ? Fmt("%.2fx", r.rate.gbps() / r.limit.gbps()) : "-",
         Cell("%.2f", limit_per_core), limit_per_core > 0 ? Fmt("%.2fx", per_core / limit_per_core) : "-"});
}

// The serialize stage of one save, everything but moving tensor bytes: plan,
// CRC combination, manifest JSON.
size_t SerializeOnce(const State& state, const Options& options, char* region) {
  auto plan = pipeline::PlanSave(1, state.tensors, options);
  Check(plan.status(), "plan the save");
  std::vector<pipeline::Chunk> chunks = pipeline::MakeChunks(*plan, region, kCrcChunk);
  std::vector<uint32_t> chunk_crc(chunks.size(), 0x1234u);
  std::vector<uint32_t> tensor_crc = pipeline::CombineChunkCrcs(*plan, chunks, chunk_crc);
  std::vector<uint32_t> shard_crc = pipeline::ShardCrcs(*plan, tensor_crc);
  format::Manifest m = pipeline::MakeManifest(*plan, tensor_crc, shard_crc, nlohmann::json::object());
  return format::SerializeManifest(m).size() + plan->shards.size();
}

// One checkpoint through LocalStorage: every shard image at once (the storage
// bounds the writes in flight), then the commit.
Task<Status> WriteCheckpoint(storage::Storage* storage, std::string name, const std::vector<storage::FileImage>* images,
                             std::string manifest) {
  CO_ASSIGN_OR_RETURN(auto writer, co_await storage->StartCheckpoint(name, /*replace=*/false));
  std::vector<Task<Status>> writes;
  for (const storage::FileImage& image : *images) writes.push_back(writer->WriteFile(&image));
  std::vector<Status> results = co_await WhenAll(std::move(writes));
  for (const Status& s : results) CO_TRY(s);
  co_return co_await writer->Commit(std::move(manifest));
}

// Local write rows: ckptio and fio alternate, so both see the disk's mood
// (this VM's disk speed drifts by 2x over minutes).
void LocalWriteRows(const Args& args, runtime::CpuPool& pool, const pipeline::SavePlan& plan, char* region,
                    Table& table) {
  auto loop_or = runtime::Loop::Create();
  Check(loop_or.status(), "create the io_uring loop");
  runtime::Loop& loop = **loop_or;
  const std::string root = args.dir + "/micro-ckpt";
  std::filesystem::remove_all(root);
  auto storage_or = loop.Run(storage::OpenLocalStorage(loop, pool, root, storage::LocalOptions{}, true));
  Check(storage_or.status(), "open LocalStorage");
  std::unique_ptr<storage::Storage> storage = std::move(*storage_or);
  const std::vector<storage::FileImage> images = pipeline::MakeImages(plan, region);
  const std::vector<uint32_t> zeros(plan.specs.size(), 0), shard_zeros(plan.shards.size(), 0);
  const std::string manifest =
      format::SerializeManifest(pipeline::MakeManifest(plan, zeros, shard_zeros, nlohmann::json::object()));
  std::vector<Rate> ours, traced, theirs;
  size_t spans = 0;
  // One write with tracing off, one with it on (the loop records a span per
  // io_uring batch, as with trace.path set), then fio.
  for (int r = 0; r < args.rounds; ++r) {
    for (bool trace : {false, true}) {
      const std::string name = "checkpoint_" + std::to_string(r + 1) + (trace ? "t" : "");
      runtime::Tracer tracer(args.dir + "/micro-trace.json");
      if (trace) loop.set_tracer(&tracer);
      Phase p;
      Check(loop.Run(WriteCheckpoint(storage.get(), name, &images, manifest)), "write a checkpoint");
      (trace ? traced : ours).push_back({p.wall(), p.cpu(), double(plan.checkpoint_bytes)});
      loop.set_tracer(nullptr);
      if (trace) {
        spans = tracer.spans();
        Check(tracer.Flush(), "write the trace");
      }
      Check(loop.Run(storage->Remove(name)), "remove a checkpoint");
    }
    if (args.fio) theirs.push_back(FioWrite(args.dir + "/micro-fio.bin", plan.checkpoint_bytes, 4 << 20, 8));
  }
  std::filesystem::remove(args.dir + "/micro-trace.json");
  storage.reset();
  std::filesystem::remove_all(root);
  const Rate fio = args.fio ? Median(theirs) : Rate{};
  AddRow(table, {"local write: LocalStorage, O_DIRECT 4 MiB x QD 8, fdatasync + commit", "loop", Median(ours),
                 args.fio ? "fio O_DIRECT write, same bytes" : "fio skipped", fio});
  AddRow(table, {"local write, tracing on (" + std::to_string(spans) + " spans of io_uring batches per checkpoint)",
                 "loop", Median(traced), "the same write, tracing off", Median(ours)});
  if (args.fio) {
    AddRow(table, {"(limit) fio O_DIRECT write, bs 4 MiB, iodepth 8, end_fsync", "fio", fio, "-", {}});
  }
}

std::string LoadAverage() {
  std::string text = RunCommand("cut -d' ' -f1-3 /proc/loadavg");
  while (!text.empty() && text.back() == '\n') text.pop_back();
  return text.empty() ? "unknown" : text;
}

std::vector<std::string> Cells(const std::string& line) {
  std::vector<std::string> out;
  std::stringstream ss(line);
  for (std::string cell; std::getline(ss, cell, '|');) {
    const size_t b = cell.find_first_not_of(' '), e = cell.find_last_not_of(' ');
    out.push_back(b == std::string::npos ? "" : cell.substr(b, e - b + 1));
  }
  return out;  // out[0] is the empty text before the first '|'
}

// HTTP and HTTPS rows from bench/upload_bench (next to this program), which
// measures GcsClient::Upload and curl -T against the same local sink.
void UploadRows(const Args& args, Table& table, std::string* note) {
  const auto dir = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  const std::string exe = (dir / "upload_bench").string();
  if (!args.upload) {
    *note = "HTTP/HTTPS upload rows skipped (--skip-upload).";
    return;
  }
  if (!std::filesystem::exists(exe) || !std::filesystem::exists(dir / "http_sink")) {
    *note = "HTTP/HTTPS upload rows skipped: " + exe + " or its http_sink is not built.";
    return;
  }
  const std::string cmd = exe + " --size-gib " + Fmt("%g", args.upload_gib) +
                          " --rounds 1 --connections 1 --schemes http,https 2>/dev/null";
  const std::string out = RunCommand(cmd);
  // Columns are found by their header names, not positions.
  std::stringstream ss(out);
  std::vector<std::string> header;
  auto column = [&](const char* name) -> int {
    auto it = std::find(header.begin(), header.end(), name);
    return it == header.end() ? -1 : static_cast<int>(it - header.begin());
  };
  int found = 0;
  for (std::string line; std::getline(ss, line);) {
    if (line.rfind("| upload |", 0) == 0) {
      header = Cells(line);
      continue;
    }
    const int ours = column("ckptio GB/s"), theirs = column("curl GB/s");
    const int ours_cpu = column("ckptio CPU s/GiB"), theirs_cpu = column("curl CPU s/GiB");
    if (std::min({ours, theirs, ours_cpu, theirs_cpu}) < 0) continue;
    for (const char* scheme : {"HTTP", "HTTPS"}) {
      if (line.rfind(std::string("| ") + scheme + ", 1 connection |", 0) != 0) continue;
      std::vector<std::string> c = Cells(line);
      if (c.size() != header.size()) continue;
      try {
        const double bytes = args.upload_gib * kGiB;
        // Rebuilt from upload_bench's GB/s and CPU s/GiB, ours and curl's.
        auto rate = [&](const std::string& gbps, const std::string& cpu_per_gib) {
          return Rate{bytes / (std::stod(gbps) * 1e9), std::stod(cpu_per_gib) * bytes / kGiB, bytes};
        };
        AddRow(table, {std::string(scheme) + " upload: GcsClient::Upload, 1 connection", "loop",
                       rate(c[ours], c[ours_cpu]), "curl -T, same sink", rate(c[theirs], c[theirs_cpu])});
        ++found;
      } catch (const std::exception&) {
      }
    }
  }
  const std::string shown = "upload_bench" + cmd.substr(exe.size(), cmd.find(" 2>") - exe.size());
  *note = found == 2 ? "HTTP/HTTPS rows: `" + shown + "` (its own table has more)."
                     : "HTTP/HTTPS upload rows missing: `" + cmd + "` printed no parsable rows for them.";
}

}  // namespace
}  // namespace ckptio::bench

int main(int argc, char** argv) {
  using namespace ckptio;
  using namespace ckptio::bench;
  const Args args = ParseArgs(argc, argv);
  std::filesystem::create_directories(args.dir);
  const size_t bytes = args.size_mib << 20;
  const size_t cores = std::max(1u, std::thread::hardware_concurrency());
  std::printf("## Throughput per core\n\n%s; %zu MiB state in ~100 tensors; median of %d rounds; files in %s\n\n",
              MachineLine().c_str(), args.size_mib, args.rounds, args.dir.c_str());

  State state = MakeState(bytes);
  AlignedBuffer warm_dst = WarmBuffer(bytes, 5);
  const Rate memcpy1 = Measure(args.rounds, bytes, [&] { ParallelMemcpy(warm_dst.get(), state.buf.get(), bytes, 1); });
  const Rate memcpyn =
      Measure(args.rounds, bytes, [&] { ParallelMemcpy(warm_dst.get(), state.buf.get(), bytes, cores); });
  warm_dst.reset();

  Table table({"stage", "threads", "GB/s", "CPU s/GiB", "GB/s per core", "limit (same run)", "limit GB/s",
               "ratio", "limit GB/s per core", "ratio per core"});
  const std::string n = std::to_string(cores);
  AddRow(table, {"(limit) memcpy into warm memory", "1", memcpy1, "-", {}});
  AddRow(table, {"(limit) memcpy into warm memory", n, memcpyn, "-", {}});

  uint32_t sink = 0;
  const Rate crc = Measure(args.rounds, bytes, [&] { sink ^= format::Crc32c(state.buf.get(), bytes); });
  AddRow(table, {"CRC32C (ISA-L)", "1", crc, "memcpy, 1 thread", memcpy1});

  Options options;  // the defaults: 256 MiB shards, header padded to 4 KiB
  auto plan = pipeline::PlanSave(1, state.tensors, options);
  Check(plan.status(), "plan the save");
  AlignedBuffer region = WarmBuffer(plan->staging_bytes, 9);
  runtime::CpuPool pool(0, "micro-cpu");
  const std::vector<pipeline::Chunk> copy = pipeline::MakeChunks(*plan, region.get(), kCopyChunk);
  const Rate snap = Measure(args.rounds, bytes, [&] { CopySnapshot(pool, *plan, region.get(), copy, nullptr); });
  AddRow(table, {"snapshot copy (what Save() blocks on; CRC in the background)", n, snap, "memcpy, " + n + " threads", memcpyn});
  const std::vector<pipeline::Chunk> crc_chunks = pipeline::MakeChunks(*plan, region.get(), kCrcChunk);
  std::vector<uint32_t> crcs(crc_chunks.size()), fused(copy.size());
  const Rate both = Measure(args.rounds, bytes, [&] {
    CopySnapshot(pool, *plan, region.get(), copy, nullptr);
    pool.ParallelFor(crc_chunks.size(), [&](size_t i) { crcs[i] = format::Crc32c(crc_chunks[i].dst, crc_chunks[i].len); });
  });
  AddRow(table, {"snapshot copy, then the background CRC32C pass over staging", n, both, "memcpy, " + n + " threads", memcpyn});
  const Rate fuse = Measure(args.rounds, bytes, [&] { CopySnapshot(pool, *plan, region.get(), copy, &fused); });
  AddRow(table, {"snapshot copy + CRC32C fused per 1 MiB chunk", n, fuse, "memcpy, " + n + " threads", memcpyn});
  // The fused and the two-pass CRCs must agree, or the rows measured different work.
  if (pipeline::CombineChunkCrcs(*plan, copy, fused) != pipeline::CombineChunkCrcs(*plan, crc_chunks, crcs)) {
    std::fprintf(stderr, "micro: fused and background CRC32C differ\n");
    return 2;
  }

  constexpr int kPlans = 200;
  size_t serialized = 0;
  const Rate ser = Measure(args.rounds, double(bytes) * kPlans, [&] {
    for (int i = 0; i < kPlans; ++i) serialized += SerializeOnce(state, options, region.get());
  });
  AddRow(table, {"serialize: safetensors headers + shard plan + manifest (" +
                     Fmt("%.0f us", ser.seconds / kPlans * 1e6) + " per save)",
                 "1", ser, "memcpy, 1 thread", memcpy1});

  LocalWriteRows(args, pool, *plan, region.get(), table);
  std::string upload_note;
  UploadRows(args, table, &upload_note);
  table.Print();
  std::printf("\nGB/s per core = bytes / CPU-seconds of the whole process (user + system). Snapshot rows use "
              "pipeline::CopySnapshot (the caller + %zu pool worker(s), 1 MiB chunks, streaming stores); the "
              "serialize row counts the state's bytes per save although it touches none of them. %s "
              "Load average at the end: %s (checksums %08x, %zu bytes of manifests)\n",
              cores - 1, upload_note.c_str(), LoadAverage().c_str(), sink, serialized);
  return 0;
}
