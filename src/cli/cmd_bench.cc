// ckptio bench seed [--state-size 1GiB] [--saves 20] [--compute 2s]
//                   [--dest DIR|gs://bucket/prefix] [--keep 3]
//                   [--modes blocking,naive,ckptio] [--out bench/results]
//
// The experiment that started the project, reproduced at this machine's
// scale (see seed_experiment.h): prints the original report's table and
// writes it to OUT/seed_<backend>.md, the ckptio run's timeline as Chrome
// trace-event JSON (OUT/seed_<backend>_trace.json; the blocking run's next
// to it) and an SVG of all runs on one time scale
// (OUT/seed_<backend>_timeline.svg).

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include "cli/commands.h"
#include "cli/common.h"
#include "cli/demo_state.h"
#include "cli/seed_experiment.h"
#include "cli/seed_report.h"
#include "cli/seed_trace.h"
#include "cli/svg_timeline.h"
#include "cli/trainer_sim.h"

namespace ckptio::cli {
namespace {

using std::chrono::nanoseconds;

// Room for the safetensors headers (padded to 4 KiB per shard) on top of
// the tensor bytes: two saves' staging must fit with them, or the second
// waits for the first (backpressure) whenever a write outlasts the compute.
constexpr uint64_t kStagingSlack = uint64_t{16} << 20;

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
    } else {
      return InvalidArgumentError("bench seed: --modes takes blocking, naive and ckptio, got \"" + word + "\"");
    }
  }
  if (modes.empty()) return InvalidArgumentError("bench seed: --modes is empty");
  return modes;
}

// Knobs the flags leave open, chosen for the experiment unless the config
// file set them (a field equal to its default counts as not set).
void TuneOptions(SeedConfig* c) {
  const Options defaults;
  Options& o = c->options;
  if (o.staging_memory == defaults.staging_memory) o.staging_memory = 2 * c->state_size + kStagingSlack;
  if (!c->gcs()) return;
  // The emulator keeps objects in Python memory and appends each chunk by
  // copying the object so far: one request per object is far cheaper, and
  // objects small enough that many upload at once hide the per-request
  // latency (measured: see the notes of bench/results/seed_gcs.md).
  if (o.shard_size == defaults.shard_size) o.shard_size = uint64_t{32} << 20;
  if (o.gcs.chunk_size == defaults.gcs.chunk_size) o.gcs.chunk_size = uint64_t{32} << 20;
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
  TuneOptions(&c);
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

// The trace JSON and the SVG: one panel per mode, on one time scale.
Status WriteTimelines(const SeedConfig& c, const std::vector<ModeResult>& results, const SeedEnvironment& env) {
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
    const std::string out = OutPath(c, r.mode == SeedMode::kCkptio ? "_trace.json" : "_blocking_trace.json");
    auto panel = MergeManagerTrace(r, out);
    std::remove(r.trace_path.c_str());
    RETURN_IF_ERROR(panel.status());
    chart.panels.push_back(std::move(*panel));
  }
  chart.legend = SeedLegend(chart.panels);
  return WriteFile(OutPath(c, "_timeline.svg"), RenderTimelineSvg(chart));
}

std::string Markdown(const SeedConfig& c, const std::vector<ModeResult>& results, const SeedEnvironment& env) {
  std::string md = "# The original experiment, reproduced: " + std::string(c.gcs() ? "GCS (emulator)" : "local disk") +
                   "\n\n" + SeedTable(results) + "\n" + SeedNotes(c, results, env);
  for (const ModeResult& r : results) {
    if (r.mode == SeedMode::kNaive) md += "\n## naive: each thread, and its checkpoint at the end\n\n" + NaiveStepTable(r);
  }
  md += "\nTimeline: seed_" + c.backend() + "_timeline.svg; Chrome trace (Perfetto, chrome://tracing): seed_" +
        c.backend() + "_trace.json (ckptio), seed_" + c.backend() + "_blocking_trace.json (blocking).\n";
  return md;
}

Status RunSeed(const SeedConfig& c, const std::string& command) {
  ASSIGN_OR_RETURN(DemoState state, DemoState::Create(c.state_size));
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
    auto r = RunSeedMode(c, mode, &state, raw);
    if (!r.ok()) return r.status().WithContext(std::string(SeedModeName(mode)) + " run");
    results.push_back(std::move(*r));
  }
  env.load_after = LoadAverage();
  const std::string md = Markdown(c, results, env);
  std::printf("\n%s\n", md.c_str());
  RETURN_IF_ERROR(WriteFile(OutPath(c, ".md"), md));
  RETURN_IF_ERROR(WriteTimelines(c, results, env));
  std::printf("wrote %s, %s\n", OutPath(c, ".md").c_str(), OutPath(c, "_timeline.svg").c_str());
  for (const ModeResult& r : results) {
    if (!r.error.empty() && r.mode != SeedMode::kNaive) {
      return IoError(std::string(SeedModeName(r.mode)) + " run failed: " + r.error);
    }
  }
  return Status::Ok();
}

std::string CommandLine(CommandArgs argv) {
  std::string out = "ckptio bench";
  for (const std::string& a : argv) out += " " + a;
  return out;
}

}  // namespace

int RunBench(CommandArgs argv) {
  ArgParser parser("bench", "seed",
                   "Benchmarks. `seed`: the experiment that started ckptio, at this machine's scale: a trainer\n"
                   "with a --state-size state computes --compute, then saves, --saves times, keeping --keep,\n"
                   "with blocking saves, a naive thread per save, and ckptio. Prints the original report's\n"
                   "table (total, blocked, overhead vs pure compute, speedup) and what each mode got wrong;\n"
                   "writes OUT/seed_<local|gcs>.md, a Chrome trace of the ckptio run (_trace.json) and an SVG\n"
                   "timeline of all runs (_timeline.svg).");
  parser.Positional("BENCH", "the benchmark: seed")
      .Flag("state-size", "SIZE", "bytes of trainer state, e.g. 256MiB (default 1GiB)")
      .Flag("saves", "N", "saves per mode (default 20)")
      .Flag("compute", "DURATION", "busy work before each save, e.g. 500ms (default 2s)")
      .Flag("dest", "DIR|gs://BUCKET/PREFIX", "where the runs write, each under DEST/<mode> (default ./ckptio-seed)")
      .Flag("dir", "DIR", "the same as --dest (the name `ckptio demo` uses)")
      .Flag("keep", "K", "checkpoints to keep (default 3)")
      .Flag("modes", "LIST", "comma-separated: blocking,naive,ckptio (default all three)")
      .Flag("out", "DIR", "where the report, trace and SVG go (default bench/results)")
      .Flag("note", "TEXT", "a line for the report's notes (how the run was set up)")
      .Switch("no-audit", "skip the per-save CRC32C of the state and the bit-exact check of what was kept")
      .Switch("cleanup", "delete each mode's checkpoints once audited");
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  if (args.positional(0) != "seed") {
    return Report(InvalidArgumentError("bench: unknown benchmark \"" + args.positional(0) + "\" (there is: seed)"));
  }
  auto config = ParseSeedArgs(args);
  if (!config.ok()) return Report(config.status());
  return Report(RunSeed(*config, CommandLine(argv)));
}

}  // namespace ckptio::cli
