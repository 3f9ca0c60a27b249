#include "runtime/trace.h"

#include <cstdio>
#include <fstream>

namespace ckptio::runtime {
namespace {

const char* TrackName(Track t) {
  switch (t) {
    case Track::kTrainer: return "trainer (Save blocked)";
    case Track::kSnapshot: return "snapshot";
    case Track::kWrite: return "write / upload";
    case Track::kChecksum: return "CRC32C";
    case Track::kCommit: return "commit";
    case Track::kPrune: return "prune";
    case Track::kRead: return "read";
    case Track::kIo: return "io_uring batches";
  }
  return "?";
}

void JsonEscape(std::string* out, std::string_view s) {
  for (char c : s) {
    if (c == '"' || c == '\\') {
      *out += '\\';
      *out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char b[8];
      std::snprintf(b, sizeof b, "\\u%04x", c);
      *out += b;
    } else {
      *out += c;
    }
  }
}

}  // namespace

Tracer::Tracer(std::string path) : path_(std::move(path)), origin_(Clock::now()) {}

void Tracer::Span(Track track, std::string_view name, Clock::time_point start, Clock::time_point end,
                  std::string args) {
  auto us = [this](Clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - origin_).count();
  };
  std::lock_guard lock(mu_);
  events_.push_back({track, std::string(name), us(start), std::max<int64_t>(0, us(end) - us(start)), std::move(args)});
}

size_t Tracer::spans() const {
  std::lock_guard lock(mu_);
  return events_.size();
}

Status Tracer::Flush() {
  std::string out = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  for (int t = static_cast<int>(Track::kTrainer); t <= static_cast<int>(Track::kIo); ++t) {
    out += "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":1,\"tid\":" + std::to_string(t) + ",\"args\":{\"name\":\"";
    JsonEscape(&out, TrackName(static_cast<Track>(t)));
    out += "\"}},\n{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":1,\"tid\":" + std::to_string(t) +
           ",\"args\":{\"sort_index\":" + std::to_string(t) + "}},\n";
  }
  {
    std::lock_guard lock(mu_);
    for (const Event& e : events_) {
      out += "{\"ph\":\"X\",\"pid\":1,\"tid\":" + std::to_string(static_cast<int>(e.track)) + ",\"name\":\"";
      JsonEscape(&out, e.name);
      out += "\",\"ts\":" + std::to_string(e.ts_us) + ",\"dur\":" + std::to_string(e.dur_us);
      if (!e.args.empty()) out += ",\"args\":" + e.args;
      out += "},\n";
    }
  }
  out += "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":1,\"args\":{\"name\":\"ckptio\"}}\n]}\n";
  const std::string tmp = path_ + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) return ErrnoToStatus(errno, "cannot write the trace file", tmp);
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    if (!f) return ErrnoToStatus(errno, "cannot write the trace file", tmp);
  }
  if (std::rename(tmp.c_str(), path_.c_str()) != 0) return ErrnoToStatus(errno, "cannot write the trace file", path_);
  return Status::Ok();
}

}  // namespace ckptio::runtime
