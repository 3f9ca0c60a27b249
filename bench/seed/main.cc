// ckptio-seed [--state-size 1GiB] [--saves 20] [--compute 2s]
//             [--dest DIR|gs://bucket/prefix] [--keep 3]
//             [--modes blocking,naive,ckptio,ckptio-borrow]
//             [--out bench/results] [--config FILE]
//
// A benchmark program of its own (build/bench/seed/ckptio-seed; it was
// `ckptio bench seed`): the shipped CLI holds only users' commands. It
// shares the demo's trainer with `ckptio demo` (src/cli/trainer_sim.h).
//
// The experiment that started the project, reproduced at this machine's
// scale (see seed_experiment.h): prints the original report's table and
// writes it to OUT/seed_<backend>.md, the ckptio run's timeline as Chrome
// trace-event JSON (OUT/seed_<backend>_trace.json; the blocking and
// ckptio-borrow runs' next to it: _blocking_trace.json, _borrow_trace.json)
// and an SVG of all runs on one time scale
// (OUT/seed_<backend>_timeline.svg).

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "base/status_macros.h"
#include "ckptio/config.h"
#include "cli/args.h"
#include "cli/common.h"
#include "cli/demo_state.h"
#include "seed/seed_experiment.h"
#include "seed/seed_report.h"
#include "seed/seed_trace.h"
#include "seed/svg_timeline.h"
#include "cli/trainer_sim.h"
#include "base/dtype.h"
#include "format/safetensors.h"

namespace ckptio::cli {
namespace {

using CommandArgs = std::span<const std::string>;

using std::chrono::nanoseconds;

// Room for the safetensors headers (padded to 4 KiB per shard) on top of
// the tensor bytes: two saves' staging must fit with them, or the second
// waits for the first (backpressure) whenever a write outlasts the compute.
constexpr uint64_t kStagingSlack = uint64_t{16} << 20;
constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr uint64_t kBlock = 4096;  // the staging pool's alignment (O_DIRECT blocks)

Result<std::vector<SeedMode>> ParseModes(const std::string& text) {
  std::vector<SeedMode> modes;
  std::stringstream ss(text);
  for (std::string word; std::getline(ss, word, ',');) {
    if (word == "blocking") {
      modes.push_back(SeedMode::kBlocking);
    } else if (word == "naive") {
      modes.push_back(SeedMode::kNaive);
    } else if (word == "ckptio") {
      modes.push_back(SeedMode::kCkptio);
    } else if (word == "ckptio-borrow") {
      modes.push_back(SeedMode::kCkptioBorrow);
    } else {
      return InvalidArgumentError("bench seed: --modes takes blocking, naive, ckptio and ckptio-borrow, got \"" +
                                  word + "\"");
    }
  }
  if (modes.empty()) return InvalidArgumentError("bench seed: --modes is empty");
  return modes;
}

// A borrowing save stages only its shards' headers (each padded to a block):
// staging for max_in_flight of them, from the state's own shard plan, in
// whole MiB (the config's unit and minimum).
Result<uint64_t> BorrowStagingMemory(const DemoState& state, const Options& o) {
  std::vector<format::TensorSpec> specs;
  for (const TensorRef& t : state.tensors()) {
    ASSIGN_OR_RETURN(uint64_t bytes, base::TensorBytes(t.dtype, t.shape));
    specs.push_back({t.name, t.dtype, t.shape, bytes});
  }
  ASSIGN_OR_RETURN(std::vector<format::PlannedShard> shards, format::PlanShards(specs, o.shard_size, kBlock));
  uint64_t per_save = 0;
  for (const format::PlannedShard& s : shards) per_save += (s.prefix.size() + kBlock - 1) / kBlock * kBlock;
  const uint64_t bytes = per_save * static_cast<uint64_t>(std::max(1, o.max_in_flight));
  return std::max<uint64_t>(kMiB, (bytes + kMiB - 1) / kMiB * kMiB);
}

// The dotted keys ("gcs.chunk_size") the config file sets, whatever their
// values: a user's explicit setting is never overridden, even one equal to
// the default.
Result<std::set<std::string>> KeysSet(const Args& args) {
  std::string path = args.Get("config").value_or("");
  if (path.empty()) {
    const char* env = std::getenv(config::kConfigEnv);
    path = env != nullptr ? env : "";
  }
  std::set<std::string> keys;
  if (path.empty()) return keys;
  std::ifstream in(path);
  if (!in) return ErrnoToStatus(errno, "cannot read the config", path);
  const nlohmann::json doc = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  std::vector<std::pair<std::string, const nlohmann::json*>> todo = {{"", &doc}};
  while (!todo.empty()) {
    auto [prefix, node] = todo.back();
    todo.pop_back();
    if (!node->is_object()) continue;
    for (const auto& [key, value] : node->items()) {
      keys.insert(prefix + key);
      todo.emplace_back(prefix + key + ".", &value);
    }
  }
  return keys;
}

// Knobs the flags leave open, chosen for the experiment unless the config
// file set them.
void TuneOptions(SeedConfig* c, const std::set<std::string>& set) {
  Options& o = c->options;
  if (set.count("staging_memory") == 0) o.staging_memory = 2 * c->state_size + kStagingSlack;
  if (!c->gcs()) return;
  // The emulator keeps objects in Python memory and appends each chunk by
  // copying the object so far: one request per object is far cheaper, and
  // objects small enough that many upload at once hide the per-request
  // latency (measured: see the notes of bench/results/seed_gcs.md).
  if (set.count("shard_size") == 0) o.shard_size = uint64_t{32} << 20;
  if (set.count("gcs.chunk_size") == 0) o.gcs.chunk_size = uint64_t{32} << 20;
}

Result<SeedConfig> ParseSeedArgs(const Args& args) {
  SeedConfig c;
  ASSIGN_OR_RETURN(c.options, LoadOptions(args));
  ASSIGN_OR_RETURN(std::optional<uint64_t> size, args.GetSize("state-size"));
  ASSIGN_OR_RETURN(std::optional<int64_t> saves, args.GetInt("saves", 1, 100'000));
  ASSIGN_OR_RETURN(std::optional<nanoseconds> compute, args.GetDuration("compute"));
  ASSIGN_OR_RETURN(std::optional<int64_t> keep, args.GetInt("keep", 0, std::numeric_limits<int>::max()));
  c.state_size = size.value_or(c.state_size);
  c.saves = static_cast<int>(saves.value_or(c.saves));
  c.compute = compute.value_or(c.compute);
  c.keep = static_cast<int>(keep.value_or(c.keep));
  // `ckptio demo` calls it --dir; either works, not both.
  if (args.Get("dest") && args.Get("dir")) {
    return InvalidArgumentError("bench seed: --dest and --dir name the same thing; give one");
  }
  c.dest = args.Get("dest").value_or(args.Get("dir").value_or(c.dest));
  c.out_dir = args.Get("out").value_or(c.out_dir);
  c.note = args.Get("note").value_or("");
  c.audit = !args.Has("no-audit");
  c.cleanup = args.Has("cleanup");
  if (auto modes = args.Get("modes")) {
    ASSIGN_OR_RETURN(c.modes, ParseModes(*modes));
  }
  ASSIGN_OR_RETURN(std::set<std::string> set, KeysSet(args));
  TuneOptions(&c, set);
  return c;
}

std::string LoadAverage() {
  double l[3] = {0, 0, 0};
  if (::getloadavg(l, 3) < 1) return "?";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", l[0]);
  return buf;
}

std::string UtcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M UTC", &tm);
  return buf;
}

Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return ErrnoToStatus(errno, "cannot write", path);
  f << text;
  if (!f.flush()) return ErrnoToStatus(errno, "cannot write", path);
  return Status::Ok();
}

std::string OutPath(const SeedConfig& c, const std::string& suffix) {
  return c.out_dir + "/seed_" + c.backend() + suffix;
}

// The merged Chrome trace of a manager's run, after OUT/seed_<backend>.
const char* TraceSuffix(SeedMode mode) {
  switch (mode) {
    case SeedMode::kCkptio: return "_trace.json";
    case SeedMode::kCkptioBorrow: return "_borrow_trace.json";
    default: return "_blocking_trace.json";
  }
}

// The trace JSON and the SVG: one panel per mode, on one time scale. The
// manager runs' panels also go to `panels`.
Status WriteTimelines(const SeedConfig& c, const std::vector<ModeResult>& results, const SeedEnvironment& env,
                      std::map<SeedMode, TimelinePanel>* panels) {
  TimelineChart chart;
  chart.title = "ckptio bench seed: the original experiment on " + std::string(c.gcs() ? "GCS (emulator)" : "local disk");
  chart.subtitle.push_back(HumanBytes(env.state_bytes) + " state, " + std::to_string(c.saves) + " saves, " +
                           HumanSeconds(std::chrono::duration<double>(c.compute).count()) +
                           " of compute before each, keep " + std::to_string(c.keep) + "; " + env.date);
  for (const ModeResult& r : results) {
    if (r.mode == SeedMode::kNaive) {
      chart.panels.push_back(NaivePanel(r));
      continue;
    }
    if (r.trace_path.empty()) continue;
    const std::string out = OutPath(c, TraceSuffix(r.mode));
    auto panel = MergeManagerTrace(r, out);
    std::remove(r.trace_path.c_str());
    RETURN_IF_ERROR(panel.status());
    (*panels)[r.mode] = *panel;
    chart.panels.push_back(std::move(*panel));
  }
  chart.legend = SeedLegend(chart.panels);
  return WriteFile(OutPath(c, "_timeline.svg"), RenderTimelineSvg(chart));
}

std::string Markdown(const SeedConfig& c, const std::vector<ModeResult>& results, const SeedEnvironment& env,
                     const std::map<SeedMode, TimelinePanel>& panels) {
  std::string md = "# The original experiment, reproduced: " + std::string(c.gcs() ? "GCS (emulator)" : "local disk") +
                   "\n\n" + SeedTable(results) + "\n" + SeedNotes(c, results, env);
  for (const ModeResult& r : results) {
    if (r.mode == SeedMode::kNaive) md += "\n## naive: each thread, and its checkpoint at the end\n\n" + NaiveStepTable(r);
  }
  for (const ModeResult& r : results) {
    auto panel = panels.find(r.mode);
    if (!IsCkptioMode(r.mode) || panel == panels.end()) continue;
    const std::string table = FinalWaitTable(r, panel->second, SeedStep(c.saves));
    if (table.empty()) continue;
    md += "\n## " + std::string(SeedModeName(r.mode)) +
          ": what the final wait waited for (from its trace; times from the start of WaitUntilFinished)\n\n" + table;
  }
  md += "\nWritten by the run next to this report, not kept in git (`make bench` makes them; "
        "bench/results/example-trace.json is a small one): timeline seed_" + c.backend() +
        "_timeline.svg; Chrome traces (Perfetto, chrome://tracing):";
  const char* sep = " ";
  for (const ModeResult& r : results) {
    if (r.mode == SeedMode::kNaive) continue;
    md += sep + ("seed_" + c.backend() + TraceSuffix(r.mode)) + " (" + SeedModeName(r.mode) + ")";
    sep = ", ";
  }
  md += ".\n";
  return md;
}

// ckptio-borrow's JAX-like trainer gets a double-buffered state of its own,
// held only for its run; the other modes share `state`, which carries on.
Result<ModeResult> RunMode(const SeedConfig& c, SeedMode mode, DemoState* state, const std::string& raw_trace) {
  if (mode != SeedMode::kCkptioBorrow) return RunSeedMode(c, mode, state, raw_trace);
  ASSIGN_OR_RETURN(DemoState two_sets, DemoState::Create(c.state_size, 2));
  return RunSeedMode(c, mode, &two_sets, raw_trace);
}

Status RunSeed(SeedConfig c, const std::string& command) {
  ASSIGN_OR_RETURN(DemoState state, DemoState::Create(c.state_size));
  ASSIGN_OR_RETURN(c.borrow_staging_memory, BorrowStagingMemory(state, c.options));
  SeedEnvironment env{UtcNow(), static_cast<int>(std::thread::hardware_concurrency()), LoadAverage(), "",
                      state.bytes(), state.tensors().size(), state.DTypeSummary(), command};
  env.copy_threads = std::max(1u, std::thread::hardware_concurrency());
  env.copy_bytes_per_s = MeasureCopyBytesPerSecond(std::min<uint64_t>(state.bytes(), uint64_t{1} << 30), env.copy_threads);
  std::error_code ec;
  std::filesystem::create_directories(c.out_dir, ec);
  if (ec) return ErrnoToStatus(ec.value(), "cannot create the output directory", c.out_dir);
  std::printf("ckptio bench seed: state %s in %zu tensors; %d saves, %s of compute before each; keep %d; %s\n"
              "  memcpy limit (warm, %u threads): %.1f GB/s\n",
              HumanBytes(state.bytes()).c_str(), state.tensors().size(), c.saves,
              HumanSeconds(std::chrono::duration<double>(c.compute).count()).c_str(), c.keep, c.dest.c_str(),
              env.copy_threads, env.copy_bytes_per_s / 1e9);
  std::vector<ModeResult> results;
  for (SeedMode mode : c.modes) {
    std::printf("%s saves into %s ...\n", SeedModeName(mode), c.ModeRoot(mode).c_str());
    std::fflush(stdout);
    const std::string raw = mode == SeedMode::kNaive ? "" : OutPath(c, std::string(".") + SeedModeName(mode) + ".raw.json");
    auto r = RunMode(c, mode, &state, raw);
    if (!r.ok()) return r.status().WithContext(std::string(SeedModeName(mode)) + " run");
    results.push_back(std::move(*r));
  }
  env.load_after = LoadAverage();
  // The timelines first: the report reads the final waits off their panels
  // (and is written even if they fail).
  std::map<SeedMode, TimelinePanel> panels;
  const Status timelines = WriteTimelines(c, results, env, &panels);
  const std::string md = Markdown(c, results, env, panels);
  std::printf("\n%s\n", md.c_str());
  RETURN_IF_ERROR(WriteFile(OutPath(c, ".md"), md));
  RETURN_IF_ERROR(timelines);
  std::printf("wrote %s, %s\n", OutPath(c, ".md").c_str(), OutPath(c, "_timeline.svg").c_str());
  for (const ModeResult& r : results) {
    if (!r.error.empty() && r.mode != SeedMode::kNaive) {
      return IoError(std::string(SeedModeName(r.mode)) + " run failed: " + r.error);
    }
  }
  return Status::Ok();
}

std::string CommandLine(CommandArgs argv) {
  std::string out = "ckptio-seed";
  for (const std::string& a : argv) out += " " + a;
  return out;
}

int Main(CommandArgs argv) {
  ArgParser parser("", "",
                   "The experiment that started ckptio, at this machine's scale: a trainer with a --state-size\n"
                   "state computes --compute, then saves, --saves times, keeping --keep, with blocking saves, a\n"
                   "naive thread per save, ckptio (copy snapshot) and ckptio-borrow (a JAX-like double-buffered\n"
                   "trainer whose saves borrow the state: no copy). Prints the original report's table (total,\n"
                   "blocked, overhead vs pure compute, speedup) and what each mode got wrong; writes\n"
                   "OUT/seed_<local|gcs>.md, Chrome traces of the manager runs (_trace.json,\n"
                   "_blocking_trace.json, _borrow_trace.json) and an SVG timeline of all runs (_timeline.svg).\n"
                   "Knobs a --config file sets are used as given; others are tuned for the experiment.",
                   "ckptio-seed");
  parser.Flag("state-size", "SIZE", "bytes of trainer state, e.g. 256MiB (default 1GiB)")
      .Flag("saves", "N", "saves per mode (default 20)")
      .Flag("compute", "DURATION", "busy work before each save, e.g. 500ms (default 2s)")
      .Flag("dest", "DIR|gs://BUCKET/PREFIX", "where the runs write, each under DEST/<mode> (default ./ckptio-seed)")
      .Flag("dir", "DIR", "the same as --dest (the name `ckptio demo` uses)")
      .Flag("keep", "K", "checkpoints to keep (default 3)")
      .Flag("modes", "LIST", "comma-separated: blocking,naive,ckptio,ckptio-borrow (default all four)")
      .Flag("out", "DIR", "where the report, trace and SVG go (default bench/results)")
      .Flag("note", "TEXT", "a line for the report's notes (how the run was set up)")
      .Switch("no-audit", "skip the per-save CRC32C of the state and the bit-exact check of what was kept")
      .Switch("cleanup", "delete each mode's checkpoints once audited");
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  auto config = ParseSeedArgs(args);
  if (!config.ok()) return Report(config.status());
  return Report(RunSeed(*config, CommandLine(argv)));
}

}  // namespace
}  // namespace ckptio::cli

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    return ckptio::cli::Main(args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ckptio-seed: internal error: %s\n", e.what());
    return ckptio::cli::kExitFailure;
  }
}
