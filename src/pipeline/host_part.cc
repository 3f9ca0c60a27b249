#include "pipeline/host_part.h"

#include <cstdio>

namespace ckptio::pipeline {

std::string ShardFilePrefix(int process, int process_count, bool local_copy) {
  if (process_count <= 1 && !local_copy) return "shard-";
  char p[40];
  std::snprintf(p, sizeof p, "%s-p%05d-", local_copy ? "replica" : "shard", process);
  return p;
}

bool IsLocalCopyFile(std::string_view file) { return file.substr(0, 9) == "replica-p"; }

std::optional<int> FileOwner(std::string_view file) {
  // A file copied under another step's name is "<that step>.<file>".
  const size_t dot = file.rfind(".shard-p");
  if (dot != std::string_view::npos) file.remove_prefix(dot + 1);
  constexpr std::string_view kPrefix = "shard-p";
  if (file.substr(0, kPrefix.size()) != kPrefix || file.size() < kPrefix.size() + 6) return std::nullopt;
  int owner = 0;
  for (size_t i = kPrefix.size(); i < kPrefix.size() + 5; ++i) {
    if (file[i] < '0' || file[i] > '9') return std::nullopt;
    owner = owner * 10 + (file[i] - '0');
  }
  if (file[kPrefix.size() + 5] != '-') return std::nullopt;
  return owner;
}

format::Manifest HeldPart(const format::Manifest& global, const format::Manifest* local_part, int process) {
  format::Manifest held = FilterShards(global, [process](const format::ManifestShard& s) {
    return FileOwner(s.name) == process;
  });
  if (local_part != nullptr) {
    const auto base = static_cast<uint32_t>(held.shards.size());
    held.shards.insert(held.shards.end(), local_part->shards.begin(), local_part->shards.end());
    for (format::ManifestTensor t : local_part->tensors) {
      t.shard += base;
      held.tensors.push_back(std::move(t));
    }
  }
  held.format_version = format::FormatVersionFor(held);
  return held;
}

}  // namespace ckptio::pipeline
