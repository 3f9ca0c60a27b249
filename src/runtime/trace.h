#pragma once
// Tracer: spans of the pipeline's stages and of the loop's I/O batches, as
// Chrome trace-event JSON (opens in Perfetto or chrome://tracing): one track
// per stage, so overlapping saves show as parallel bars.
//
// Off by default (no Tracer at all): every instrumented place is a null
// check. Thread-safe: spans may come from any thread.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "ckptio/status.h"

namespace ckptio::runtime {

enum class Track : int {
  kTrainer = 1,  // what the caller's thread spends in ckptio (Save blocking)
  kSnapshot,
  kWrite,        // shard writes / uploads
  kChecksum,
  kCommit,
  kPrune,
  kRead,         // restore and verify
  kIo,           // io_uring submit/reap batches
};

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  // A tracer that writes to `path` on Flush().
  explicit Tracer(std::string path);

  // Records [start, end) on `track`. `args` is a JSON object's text or empty.
  void Span(Track track, std::string_view name, Clock::time_point start, Clock::time_point end,
            std::string args = {});
  // Writes every span so far to the file (atomically: tmp + rename).
  Status Flush();

  const std::string& path() const { return path_; }
  size_t spans() const;

 private:
  struct Event {
    Track track;
    std::string name;
    int64_t ts_us;
    int64_t dur_us;
    std::string args;
  };
  std::string path_;
  Clock::time_point origin_;
  mutable std::mutex mu_;
  std::vector<Event> events_;  // guarded by mu_
};

// Times a scope into a tracer (if any).
class ScopedSpan {
 public:
  ScopedSpan(Tracer* tracer, Track track, std::string name)
      : tracer_(tracer), track_(track), name_(tracer ? std::move(name) : std::string()),
        start_(tracer ? Tracer::Clock::now() : Tracer::Clock::time_point()) {}
  ~ScopedSpan() {
    if (tracer_ != nullptr) tracer_->Span(track_, name_, start_, Tracer::Clock::now(), std::move(args_));
  }
  void set_args(std::string args) { args_ = std::move(args); }

 private:
  Tracer* tracer_;
  Track track_;
  std::string name_;
  Tracer::Clock::time_point start_;
  std::string args_;
};

}  // namespace ckptio::runtime
