#include "seed/seed_trace.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "base/status_macros.h"
#include "seed/seed_report.h"

namespace ckptio::cli {
namespace {

using nlohmann::json;

// Our tids, clear of the manager's (runtime::Track is 1..8).
constexpr int kComputeTid = 100;
constexpr int kSavesTid = 101;
constexpr int kBorrowWaitTid = 102;

struct TrackStyle {
  const char* name;
  const char* color;
};
// Rows top to bottom; the manager's names are runtime/trace.cc's.
constexpr TrackStyle kStyles[] = {
    {kComputeTrack, "#43a047"},
    {"trainer (Save blocked)", "#e53935"},
    {kBorrowWaitTrack, "#e53935"},
    {"trainer (thread spawn)", "#e53935"},
    {"snapshot", "#fb8c00"},
    {"write / upload", "#1e88e5"},
    {"naive threads: write", "#1e88e5"},
    {"CRC32C", "#8e24aa"},
    {"commit", "#00897b"},
    {"prune", "#6d4c41"},
    {"naive threads: prune", "#6d4c41"},
    {"read", "#3949ab"},
    {"io_uring batches", "#78909c"},
    {kSavesTrack, "#fbc02d"},
};

std::string ColorOf(const std::string& track) {
  for (const TrackStyle& s : kStyles) {
    if (track == s.name) return s.color;
  }
  return "#9e9e9e";
}

// The tracks of `spans` that have something in [0, duration], in kStyles order.
std::vector<TimelineTrack> TracksOf(const std::vector<TimelineSpan>& spans, double duration) {
  std::set<std::string> used;
  for (const TimelineSpan& s : spans) {
    if (s.end >= 0 && s.start <= duration) used.insert(s.track);
  }
  std::vector<TimelineTrack> tracks;
  for (const TrackStyle& s : kStyles) {
    if (used.erase(s.name) != 0) tracks.push_back({s.name, s.color});
  }
  for (const std::string& name : used) tracks.push_back({name, ColorOf(name)});
  return tracks;
}

int64_t Micros(double seconds) { return static_cast<int64_t>(seconds * 1e6 + 0.5); }

// The manager's clock starts when it opened; ours when the timed run began.
// Both recorded each Save() call (ours just before it, the manager's at its
// first line): the smallest difference is the offset, to a microsecond.
Result<int64_t> AlignOffset(const json& events, const ModeResult& r) {
  std::map<std::string, double> ours;
  for (const TimedSpan& s : r.spans) {
    if (s.track == kSaveCallTrack) ours[s.name] = s.start;
  }
  int64_t best = std::numeric_limits<int64_t>::max();
  for (const json& e : events) {
    if (e.value("ph", "") != "X" || e.value("tid", 0) != 1) continue;
    auto it = ours.find(e.value("name", ""));
    if (it != ours.end()) best = std::min(best, e.value("ts", int64_t{0}) - Micros(it->second));
  }
  if (best == std::numeric_limits<int64_t>::max()) {
    return InternalError("the manager's trace has no Save() span of the timed run to align with");
  }
  return best;
}

void AddThread(json* events, int tid, const std::string& name) {
  events->push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", 1}, {"tid", tid}, {"args", {{"name", name}}}});
  events->push_back({{"ph", "M"}, {"name", "thread_sort_index"}, {"pid", 1}, {"tid", tid},
                     {"args", {{"sort_index", tid == kComputeTid ? 0 : tid}}}});
}

// Adds the bench's spans to the trace, shifted onto the manager's clock.
void AddOurSpans(json* events, const ModeResult& r, int64_t offset) {
  AddThread(events, kComputeTid, kComputeTrack);
  AddThread(events, kSavesTid, kSavesTrack);
  const bool waits = std::any_of(r.spans.begin(), r.spans.end(),
                                 [](const TimedSpan& s) { return s.track == kBorrowWaitTrack; });
  if (waits) AddThread(events, kBorrowWaitTid, kBorrowWaitTrack);
  for (const TimedSpan& s : r.spans) {
    int tid = 0;
    if (s.track == kComputeTrack) tid = kComputeTid;
    if (s.track == kSavesTrack) tid = kSavesTid;
    if (s.track == kBorrowWaitTrack) tid = kBorrowWaitTid;
    if (tid == 0) continue;  // save calls: the manager's own trainer track has them
    events->push_back({{"ph", "X"}, {"pid", 1}, {"tid", tid}, {"name", s.name},
                       {"ts", Micros(s.start) + offset}, {"dur", std::max<int64_t>(0, Micros(s.end - s.start))}});
  }
  events->push_back({{"ph", "i"}, {"pid", 1}, {"tid", kComputeTid}, {"s", "g"}, {"name", "timed run starts"},
                     {"ts", offset}});
}

// The trace's complete ("X") events as spans in seconds since the run began.
std::vector<TimelineSpan> SpansOf(const json& events, int64_t offset) {
  std::map<int, std::string> names;
  for (const json& e : events) {
    if (e.value("ph", "") == "M" && e.value("name", "") == "thread_name") {
      names[e.value("tid", 0)] = e["args"].value("name", "");
    }
  }
  std::vector<TimelineSpan> spans;
  for (const json& e : events) {
    if (e.value("ph", "") != "X") continue;
    TimelineSpan s;
    s.track = names[e.value("tid", 0)];
    s.name = e.value("name", "");
    s.start = static_cast<double>(e.value("ts", int64_t{0}) - offset) / 1e6;
    s.end = s.start + static_cast<double>(e.value("dur", int64_t{0})) / 1e6;
    if (s.name == kAuditSpanName) s.color = kAuditColor;
    spans.push_back(std::move(s));
  }
  return spans;
}

Result<json> ReadJson(const std::string& path) {
  std::ifstream f(path);
  if (!f) return ErrnoToStatus(errno, "cannot read the manager's trace", path);
  json j = json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("traceEvents") || !j["traceEvents"].is_array()) {
    return CorruptionError("the manager's trace " + path + " is not Chrome trace-event JSON");
  }
  return j;
}

Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return ErrnoToStatus(errno, "cannot write", path);
  f << text;
  if (!f.flush()) return ErrnoToStatus(errno, "cannot write", path);
  return Status::Ok();
}

// Drops spans that begin before the manager's clock started: runtime::Loop
// can record one I/O batch from the zero time_point when tracing is switched
// on while the loop is waiting in io_uring_enter (seen: a "batch of 1"
// lasting 13,000 s), which would stretch every timeline.
int DropImpossibleSpans(json* events) {
  const size_t before = events->size();
  json kept = json::array();
  for (json& e : *events) {
    if (e.value("ph", "") == "X" && e.value("ts", int64_t{0}) < 0) continue;
    kept.push_back(std::move(e));
  }
  *events = std::move(kept);
  return static_cast<int>(before - events->size());
}

Result<TimelinePanel> Merge(const ModeResult& r, const std::string& out_path) {
  ASSIGN_OR_RETURN(json trace, ReadJson(r.trace_path));
  json& events = trace["traceEvents"];
  if (const int dropped = DropImpossibleSpans(&events); dropped > 0) {
    std::fprintf(stderr, "ckptio: dropped %d span(s) of %s that start before the manager opened\n", dropped,
                 r.trace_path.c_str());
  }
  ASSIGN_OR_RETURN(int64_t offset, AlignOffset(events, r));
  AddOurSpans(&events, r, offset);
  // One event per line: greppable, and diffs stay readable.
  std::ostringstream text;
  text << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  for (size_t i = 0; i < events.size(); ++i) text << events[i].dump() << (i + 1 < events.size() ? ",\n" : "\n");
  text << "]}\n";
  RETURN_IF_ERROR(WriteText(out_path, text.str()));
  TimelinePanel p;
  p.title = std::string(SeedModeName(r.mode)) + " (" + HumanPanelSummary(r) + ")";
  p.duration = r.wall;
  p.spans = SpansOf(events, offset);
  p.tracks = TracksOf(p.spans, p.duration);
  return p;
}

}  // namespace

Result<TimelinePanel> MergeManagerTrace(const ModeResult& result, const std::string& out_path) {
  try {
    return Merge(result, out_path);
  } catch (const json::exception& e) {
    return CorruptionError("cannot read the manager's trace " + result.trace_path + ": " + e.what());
  }
}

std::string FinalWaitTable(const ModeResult& r, const TimelinePanel& panel, int64_t last_step) {
  const double w0 = r.wall - r.final_wait;  // the panel's clock: the run's, audit pauses included
  const std::string step = std::to_string(last_step);
  const std::string of_step = "(step " + step + ")";
  std::vector<const TimelineSpan*> rows;
  double commit_start = -1;
  for (const TimelineSpan& s : panel.spans) {
    const bool mine = s.name == "snapshot " + step || s.name == "CRC32C " + step || s.name == "commit " + step ||
                      (s.track == "write / upload" && s.name.size() >= of_step.size() &&
                       s.name.compare(s.name.size() - of_step.size(), of_step.size(), of_step) == 0);
    if (mine) rows.push_back(&s);
    if (s.name == "commit " + step) commit_start = s.start;
  }
  if (rows.empty() || r.final_wait <= 0) return "";
  // The prune after the last commit: what WaitUntilFinished also waits for.
  for (const TimelineSpan& s : panel.spans) {
    if (s.track == "prune" && commit_start >= 0 && s.start >= commit_start) rows.push_back(&s);
  }
  std::sort(rows.begin(), rows.end(), [](const TimelineSpan* a, const TimelineSpan* b) { return a->start < b->start; });
  char line[256];
  std::string out = "| stage of the last save | track | starts | ends | takes |\n|---|---|---:|---:|---:|\n";
  for (const TimelineSpan* s : rows) {
    std::snprintf(line, sizeof line, "| %s | %s | %+.3f s | %+.3f s | %.3f s |\n", s->name.c_str(), s->track.c_str(),
                  s->start - w0, s->end - w0, s->end - s->start);
    out += line;
  }
  std::snprintf(line, sizeof line, "| WaitUntilFinished returns | | | %+.3f s | |\n", r.final_wait);
  return out + line;
}

TimelinePanel NaivePanel(const ModeResult& r) {
  TimelinePanel p;
  p.title = std::string(SeedModeName(r.mode)) + " (" + HumanPanelSummary(r) + ")";
  p.duration = r.wall;
  for (TimedSpan s : r.spans) {
    if (s.track == kSaveCallTrack) s.track = "trainer (thread spawn)";
    if (s.name == kAuditSpanName) s.color = kAuditColor;
    p.spans.push_back(std::move(s));
  }
  p.tracks = TracksOf(p.spans, p.duration);
  return p;
}

std::vector<std::pair<std::string, std::string>> SeedLegend(const std::vector<TimelinePanel>& panels) {
  std::vector<std::pair<std::string, std::string>> legend;
  std::set<std::string> used;
  for (const TimelinePanel& p : panels) {
    for (const TimelineTrack& t : p.tracks) used.insert(t.name);
  }
  // Tracks of one color (the same stage in different modes) share an entry.
  for (const TrackStyle& s : kStyles) {
    if (used.count(s.name) == 0) continue;
    auto same = std::find_if(legend.begin(), legend.end(), [&s](const auto& e) { return e.second == s.color; });
    if (same != legend.end()) {
      same->first += std::string(" / ") + s.name;
    } else {
      legend.emplace_back(s.name, s.color);
    }
  }
  bool audit = false;
  for (const TimelinePanel& p : panels) {
    for (const TimelineSpan& s : p.spans) audit = audit || s.name == kAuditSpanName;
  }
  if (audit) legend.emplace_back("audit CRC32C of the state (untimed)", kAuditColor);
  return legend;
}

}  // namespace ckptio::cli
