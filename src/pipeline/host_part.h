#pragma once
// Multi-host saves: which files of a checkpoint are whose, and a host's own
// part of a step in its local tier (two tiers).
//
// Every process of a multi-host save writes files named after it
// ("shard-p00003-00000.safetensors"); only those go to the shared
// checkpoint. With two tiers each host's local tier holds, besides its own
// files and a copy of the whole manifest, its *local copies*: the tensors its
// devices hold that another process writes to the checkpoint (a replicated
// array's other half, the scalars process 0 writes), in files of its own
// ("replica-p00003-00000.safetensors"), indexed by local-part.json (a
// manifest of those tensors and files, never sent to the remote tier). A
// restore on that host then reads everything it holds from its own disk.

#include <optional>
#include <string>
#include <string_view>

#include "format/manifest.h"

namespace ckptio::pipeline {

// The index of a host's local copies in a step of its local tier.
inline constexpr const char* kLocalPartFile = "local-part.json";

// "shard-p00003-" for process 3's own files, "replica-p00003-" for its local
// copies, "shard-" for a process that saves alone.
std::string ShardFilePrefix(int process, int process_count, bool local_copy);

// Whether `file` (a shard's name, perhaps of an earlier checkpoint) holds
// local copies.
bool IsLocalCopyFile(std::string_view file);

// The process whose own file `file` is ("shard-p00003-..." -> 3, also as
// "checkpoint_1.shard-p00003-..." once copied under another step's name),
// or nullopt (a single process's file, local copies, anything else).
std::optional<int> FileOwner(std::string_view file);

// The tensors and shards of `m` in files for which `keep(shard)` holds, the
// shard indices renumbered. Every other field is `m`'s.
template <typename Keep>
format::Manifest FilterShards(const format::Manifest& m, Keep keep) {
  format::Manifest out = m;
  out.shards.clear();
  out.tensors.clear();
  std::vector<int64_t> index(m.shards.size(), -1);
  for (size_t i = 0; i < m.shards.size(); ++i) {
    if (!keep(m.shards[i])) continue;
    index[i] = static_cast<int64_t>(out.shards.size());
    out.shards.push_back(m.shards[i]);
  }
  for (const format::ManifestTensor& t : m.tensors) {
    if (index[t.shard] < 0) continue;
    out.tensors.push_back(t);
    out.tensors.back().shard = static_cast<uint32_t>(index[t.shard]);
  }
  out.format_version = format::FormatVersionFor(out);
  return out;
}

// What host `process` holds of a step: the tensors of `global` in its own
// files, and its local copies (`local_part`, may be null), as one manifest
// of this step (a partial one: Chunks::kPartial).
format::Manifest HeldPart(const format::Manifest& global, const format::Manifest* local_part, int process);

}  // namespace ckptio::pipeline
