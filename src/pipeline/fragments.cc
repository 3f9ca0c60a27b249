#include "pipeline/fragments.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <vector>

#include "base/status_macros.h"
#include "runtime/when_all.h"
#include "runtime/io_ops.h"

namespace ckptio::pipeline {
namespace {

constexpr std::chrono::milliseconds kFirstFragmentPoll{20};

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

PollBackoff::PollBackoff(int process_count, std::chrono::milliseconds first)
    : next_(first),
      cap_(std::max<std::chrono::milliseconds>(std::chrono::milliseconds(1000),
                                               std::chrono::milliseconds(2 * int64_t{process_count}))),
      rng_(static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) | 1) {}

std::chrono::milliseconds PollBackoff::Next(std::chrono::steady_clock::time_point deadline) {
  rng_ ^= rng_ << 13;  // xorshift64: jitter needs no quality
  rng_ ^= rng_ >> 7;
  rng_ ^= rng_ << 17;
  const int64_t base = next_.count();
  next_ = std::min(cap_, next_ * 2);
  const std::chrono::milliseconds wait(base * 3 / 4 + static_cast<int64_t>(rng_ % static_cast<uint64_t>(base / 2 + 1)));
  const auto remaining =
      std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  return std::clamp(wait, std::chrono::milliseconds(1), std::max(remaining, std::chrono::milliseconds(1)));
}

std::string FragmentName(int process) {
  char b[64];
  std::snprintf(b, sizeof b, "fragment-p%05d.json", process);
  return b;
}

std::string MakeFragment(format::Manifest part, int64_t step, int index, int count, const Status& error,
                         nlohmann::json extra) {
  if (!error.ok()) {
    part.tensors.clear();
    part.shards.clear();
  }
  part.step = step;
  part.created = format::FormatRfc3339Utc(std::chrono::system_clock::now());
  part.writer = std::string("ckptio ") + CKPTIO_VERSION;
  part.metadata = {{"process_index", index}, {"process_count", count}, {"written_at_ms", NowMs()}};
  if (!error.ok()) part.metadata["error"] = error.message();
  part.metadata.update(extra);
  return format::SerializeManifest(part);
}

Task<Result<format::Manifest>> GatherFragments(runtime::Loop& loop, storage::CheckpointWriter* writer, GatherSpec spec) {
  const int count = spec.count;
  const int64_t step = spec.step;
  const auto deadline = std::chrono::steady_clock::now() + spec.timeout;
  // Fragments older than this are left over from an earlier attempt at the
  // same step (the storage fallback cannot tell otherwise).
  const int64_t oldest_ms = NowMs() - spec.timeout.count();
  std::vector<std::optional<format::Manifest>> got(count);
  PollBackoff backoff(count, kFirstFragmentPoll);
  for (;;) {
    // Every missing fragment at once: the reads run in parallel over the
    // connection pool, so gathering costs about one round trip per
    // `connections` fragments, not one per process.
    std::vector<int> wanted;
    std::vector<Task<Result<std::string>>> reads;
    for (int p = 0; p < count; ++p) {
      if (got[p]) continue;
      wanted.push_back(p);
      reads.push_back(writer->ReadSmall(FragmentName(p), format::kMaxManifestBytes));
    }
    std::vector<Result<std::string>> bytes = co_await WhenAll(std::move(reads));
    std::vector<int> missing;
    for (size_t i = 0; i < wanted.size(); ++i) {
      const int p = wanted[i];
      if (!bytes[i].ok() && bytes[i].status().code() != StatusCode::kNotFound) co_return bytes[i].status();
      if (bytes[i].ok()) {
        CO_ASSIGN_OR_RETURN(format::Manifest f,
                            format::ParseManifest(spec.step_name + "/" + FragmentName(p), *bytes[i],
                                                  format::Chunks::kPartial));
        const bool current = spec.accept ? spec.accept(p, f) : f.metadata.value("written_at_ms", int64_t{0}) >= oldest_ms;
        if (f.step == step && current) got[p] = std::move(f);
      }
      if (!got[p]) missing.push_back(p);
    }
    if (missing.empty()) break;
    if (!spec.poll || std::chrono::steady_clock::now() >= deadline) {
      std::string who;  // the first few; a 2,048-process job must not log 2,048 numbers
      for (size_t i = 0; i < missing.size() && i < 16; ++i) who += (i ? ", " : "") + std::to_string(missing[i]);
      if (missing.size() > 16) who += " and " + std::to_string(missing.size() - 16) + " more";
      const std::string what =
          spec.waiting_for.empty() ? "barrier \"written/" + std::to_string(step) + "\"" : spec.waiting_for;
      co_return DeadlineExceededError(what + ": no fragment from process" +
                                      (missing.size() > 1 ? "es " : " ") + who + " after " +
                                      std::to_string(spec.timeout.count()) + " ms");
    }
    Status slept = co_await loop.Sleep(backoff.Next(deadline));
    slept.IgnoreError();
  }
  std::vector<format::Manifest> fragments;
  for (std::optional<format::Manifest>& f : got) fragments.push_back(std::move(*f));
  co_return MergeFragments(fragments, step, spec.step_name, std::move(spec.metadata));
}

Result<format::Manifest> MergeFragments(const std::vector<format::Manifest>& fragments, int64_t step,
                                        const std::string& step_name, nlohmann::json metadata) {
  format::Manifest merged;
  merged.step = step;
  merged.created = fragments.empty() ? format::FormatRfc3339Utc(std::chrono::system_clock::now())
                                     : fragments[0].created;
  merged.writer = std::string("ckptio ") + CKPTIO_VERSION;
  merged.metadata = std::move(metadata);
  for (size_t p = 0; p < fragments.size(); ++p) {
    const format::Manifest& f = fragments[p];
    if (f.metadata.contains("error")) {
      return UnavailableError("process " + std::to_string(p) + " failed to write its part of step " +
                              std::to_string(step) + ": " + f.metadata["error"].get<std::string>());
    }
    const auto base = static_cast<uint32_t>(merged.shards.size());
    merged.shards.insert(merged.shards.end(), f.shards.begin(), f.shards.end());
    for (format::ManifestTensor t : f.tensors) {
      t.shard += base;
      merged.tensors.push_back(std::move(t));
    }
  }
  merged.format_version = format::FormatVersionFor(merged);
  RETURN_IF_ERROR(format::ValidateManifest(
      step_name + "/manifest.json (merged from " + std::to_string(fragments.size()) + " fragments)", merged));
  return merged;
}

}  // namespace ckptio::pipeline
