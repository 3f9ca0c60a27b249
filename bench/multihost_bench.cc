// bench/multihost_bench: how a multi-host commit scales with the number of
// processes, against the GCS emulator (run under tests/gcs/with_gcs.py; see
// bench/multihost_bench.sh).
//
// For P = 1, 2, 4, ..., max: P simulated processes (coroutines on one loop,
// each with its own shared writer, as separate hosts would have) each upload
// a small shard and their fragment; then process 0's commit is timed: gather
// the P fragments (parallel ranged reads, the code CheckpointManager runs)
// and write the manifest. Reported: commit latency, its ratio to one request
// round trip and to log2(P), and the requests it made.
//
//   multihost_bench [--max-processes 1024] [--connections 16] [--latency-ms N (what the proxy adds)]

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "base/status_macros.h"
#include "bench_util.h"
#include "runtime/when_all.h"
#include "format/crc32c.h"
#include "format/manifest.h"
#include "pipeline/fragments.h"
#include "runtime/loop.h"
#include "storage/gcs_storage.h"

namespace ckptio::bench {
namespace {

// One simulated process's part: one 4 KiB shard holding one tensor.
format::Manifest Part(int process) {
  format::Manifest m;
  char shard[64];
  std::snprintf(shard, sizeof shard, "shard-p%05d-00000.safetensors", process);
  m.shards.push_back({shard, 4096 + 64, 0, {}});
  m.tensors.push_back({"p" + std::to_string(process) + "/w", DType::kU8, {64}, 0, 4096, 64, 0, {}, {}});
  return m;
}

struct Point {
  int processes;
  double gather_ms;  // the P fragment reads (parallel) and the merge
  double commit_ms;  // gather + the manifest write
  uint64_t requests;
};

Task<Result<Point>> OnePoint(runtime::Loop* loop, storage::Storage* storage, int processes, int64_t step,
                             const std::string* shard_bytes) {
  const std::string name = "checkpoint_" + std::to_string(step);
  std::vector<std::unique_ptr<storage::CheckpointWriter>> writers;
  for (int p = 0; p < processes; ++p) {
    CO_ASSIGN_OR_RETURN(auto w, co_await storage->StartCheckpoint(name, false, /*shared=*/true));
    writers.push_back(std::move(w));
  }
  // Every process writes its shard and its fragment (not timed).
  std::vector<storage::FileImage> images(processes);
  std::vector<Task<Status>> writes;
  for (int p = 0; p < processes; ++p) {
    format::Manifest part = Part(p);
    images[p].name = part.shards[0].name;
    images[p].size = shard_bytes->size();
    images[p].segments.push_back({0, shard_bytes->data(), shard_bytes->size(), shard_bytes->size()});
    writes.push_back(writers[p]->WriteFile(&images[p]));
    writes.push_back(writers[p]->WriteSmall(pipeline::FragmentName(p),
                                            pipeline::MakeFragment(std::move(part), step, p, processes, Status::Ok())));
  }
  std::vector<Status> written = co_await WhenAll(std::move(writes));
  for (Status& s : written) CO_TRY(s);
  // Process 0's commit, timed.
  const uint64_t before = storage->requests();
  Phase t;
  // The fragments were all written above, minutes ago for large P: a long timeout keeps the gather
  // from taking them for an earlier attempt's leftovers.
  pipeline::GatherSpec spec{processes, step, name, std::chrono::milliseconds(3600000), false, nlohmann::json::object()};
  CO_ASSIGN_OR_RETURN(format::Manifest merged, co_await pipeline::GatherFragments(*loop, writers[0].get(), spec));
  const double gather_ms = t.wall() * 1e3;
  CO_TRY(co_await writers[0]->Commit(format::SerializeManifest(merged)));
  co_return Point{processes, gather_ms, t.wall() * 1e3, storage->requests() - before};
}

// The round trip of one small request: the unit the target is stated in.
Task<Result<double>> RoundTripMs(storage::Storage* storage, int64_t step) {
  double best = 1e9;
  for (int i = 0; i < 20; ++i) {
    Phase t;
    auto r = co_await storage->OpenFile("checkpoint_" + std::to_string(step), "manifest.json");  // one GET
    if (!r.ok()) co_return r.status();
    best = std::min(best, t.wall() * 1e3);
  }
  co_return best;
}

}  // namespace
}  // namespace ckptio::bench

int main(int argc, char** argv) {
  using namespace ckptio;
  using namespace ckptio::bench;
  int max_processes = 1024, connections = 16, latency_ms = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::string(argv[i]) == "--max-processes") max_processes = std::atoi(argv[i + 1]);
    if (std::string(argv[i]) == "--connections") connections = std::atoi(argv[i + 1]);
    if (std::string(argv[i]) == "--latency-ms") latency_ms = std::atoi(argv[i + 1]);  // for the report
  }
  const char* bucket = std::getenv("CKPTIO_TEST_BUCKET");
  if (bucket == nullptr || std::getenv("STORAGE_EMULATOR_HOST") == nullptr) {
    std::fprintf(stderr, "run under tests/gcs/with_gcs.py (bench/multihost_bench.sh)\n");
    return 1;
  }
  auto loop = std::move(runtime::Loop::Create()).value();
  Options::Gcs gcs;
  gcs.connections = connections;
  const std::string root = std::string("gs://") + bucket + "/multihost-bench";
  auto storage = loop->Run(storage::OpenGcsStorage(*loop, root, gcs));
  if (!storage.ok()) {
    std::fprintf(stderr, "%s\n", storage.status().ToString().c_str());
    return 2;
  }
  const std::string shard_bytes(4096 + 64, 'x');
  Table t({"processes", "commit", "fragment reads", "reads / (ceil(P/conn) RTT)", "commit beyond reads",
           "beyond / RTT", "log2(P)", "requests", "requests / P"});
  double rtt = 0;
  int64_t step = 1;
  for (int p = 1; p <= max_processes; p *= 2, ++step) {
    auto point = loop->Run(OnePoint(loop.get(), storage->get(), p, step, &shard_bytes));
    if (!point.ok()) {
      std::fprintf(stderr, "P=%d: %s\n", p, point.status().ToString().c_str());
      return 2;
    }
    if (rtt == 0) rtt = loop->Run(RoundTripMs(storage->get(), step)).value();
    const double waves = std::ceil(double(p) / connections);
    const double beyond = point->commit_ms - point->gather_ms;
    t.Add({std::to_string(p), Fmt("%.1f ms", point->commit_ms), Fmt("%.1f ms", point->gather_ms),
           Fmt("%.2f", point->gather_ms / (waves * rtt)), Fmt("%.1f ms", beyond), Fmt("%.1f", beyond / rtt),
           Fmt("%.0f", std::log2(p)), std::to_string(point->requests), Fmt("%.2f", double(point->requests) / p)});
  }
  std::printf("## Multi-host commit latency vs processes\n\n%s; GCS emulator (tests/gcs) on 127.0.0.1 behind a proxy "
              "adding %d ms per request; one request round trip = %.2f ms (best of 20); %d connections\n\n",
              MachineLine().c_str(), latency_ms, rtt, connections);
  t.Print();
  std::printf("\ncommit = process 0 gathering the P fragments (parallel GETs over the connection pool, then the "
              "merge) + writing the manifest. The fragments' own uploads happen on the other hosts, before, and "
              "are not counted; neither are the barriers (MPI_Ibarrier: log2(P) message rounds, no storage "
              "request). \"reads / (ceil(P/conn) RTT)\" near 1 means the reads run as parallel as the pool "
              "allows; \"beyond / RTT\" is the commit's cost on top of them in round trips (target: <= log2(P)).\n");
  return 0;
}
