#pragma once
// Options: every knob that tunes ckptio, with its default.
//
// A plain struct on purpose: C++ callers fill it in code, and the config layer
// (src/config/) fills it from a JSON file. Each field's default lives here and
// only here; the config layer reads defaults from a default-constructed
// Options, so `ckptio config defaults` cannot disagree with this header.
// Validate options built in code with ckptio::config::ValidateOptions().
// The config file uses the member names below as keys, nested the same way
// ({"io": {"block_size": "4MiB"}}).

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace ckptio {

enum class SnapshotMode {
  kCopy,    // copy tensors into staging; the caller may mutate them once save() returns
  kBorrow,  // no copy: the caller promises its buffers stay unchanged until the save ends
  // Copy into staging on a ckptio thread: save() returns once the save is
  // admitted (staging reserved), before the copy. The caller promises its
  // buffers stay unchanged until SaveHandle::WaitSnapshot() returns (or
  // CheckpointManager::WaitSnapshots()), which is when the copy is done:
  // a trainer whose next write to the state is an optimizer step waits
  // there, and the copy overlaps its forward and backward passes.
  kBackground,
};

enum class SnapshotCrc {
  kBackground,  // CRC32C in a background pass while the shards are written
  kFused,       // CRC32C during the snapshot copy, while each chunk is in cache
};

enum class OnBusy {
  kWait,  // a save that does not fit in free staging waits for room (backpressure)
  kSkip,  // such a save is dropped and reported as ResourceExhausted
};

struct Options {
  // Most bytes of staging memory that copy-mode saves copy their snapshot
  // into; reused by every save, never allocated per save.
  //  0 ("auto"): grows to what the saves need (up to half the machine's
  //    memory), faulted in as it grows: a small state costs small memory.
  //  N: pre-faulted in the background right after Open, so that even the
  //    first save copies into warm memory (never while a restore runs; in
  //    a root that holds checkpoints, from the end of the first restore or
  //    the first save).
  // A save that needs more than the bound is written straight from the
  // caller's buffers and Save() returns once it is written (the trainer
  // waits for the write instead of a copy; warned once).
  uint64_t staging_memory = 0;  // auto
  // Max bytes of tensor data per shard file (a larger tensor gets a shard of its own).
  uint64_t shard_size = uint64_t{256} << 20;  // 256 MiB
  SnapshotMode snapshot = SnapshotMode::kCopy;
  // When copy-mode snapshots compute CRC32C: "background" keeps the trainer's
  // wait to the copy alone; "fused" saves one pass over memory.
  SnapshotCrc snapshot_crc = SnapshotCrc::kBackground;
  OnBusy on_busy = OnBusy::kWait;
  // Saves running in the background at once.
  int max_in_flight = 2;
  // Committed checkpoints to keep; 0 keeps all.
  int keep = 3;
  // Every K-th step is kept forever, whatever `keep` says; 0 = off.
  int64_t keep_every = 0;
  // Directory / object name prefix of a step ("checkpoint_" + "200").
  std::string prefix = "checkpoint_";
  // Replace a committed checkpoint of the same step instead of failing.
  bool overwrite = false;
  // Incremental saves: a tensor whose bytes (XXH3-128 content hash, and
  // CRC32C) did not change since the last committed step is not written
  // again; the new manifest points into the earlier step's shard, which
  // retention keeps while a kept step refers to it.
  bool incremental = false;
  // CPU pool workers; 0 = one per core.
  int threads = 0;

  struct Io {
    enum class Direct { kAuto, kOn, kOff };
    // Bytes per write request; a multiple of 4096 so O_DIRECT writes stay aligned.
    uint64_t block_size = uint64_t{4} << 20;  // 4 MiB
    // Writes in flight, all files together. Borrowed tensors that are not
    // 4 KiB-aligned in memory go out O_DIRECT through this many bounce
    // buffers of block_size bytes (mapped at the first such write, reused).
    int queue_depth = 8;
    // O_DIRECT: kAuto tries it and falls back to buffered I/O where refused.
    Direct direct = Direct::kAuto;
    // Register staging buffers with io_uring (fixed buffers).
    bool register_buffers = true;
    // Keep the files of checkpoints that retention prunes and write the next
    // save's shards into them: a prune renames instead of deleting (on ext4
    // with online discard a 256 MiB unlink took ~50 ms), and a save skips
    // allocating its files (overwriting written blocks beats filling
    // unwritten extents). The disk then holds up to one pruned checkpoint's
    // files more, in <root>/.recycle. Deleting a step still frees its space.
    bool recycle = true;
    friend bool operator==(const Io&, const Io&) = default;
  } io;

  struct Trace {
    // Chrome trace-event JSON written here; empty = tracing off.
    std::string path;
    friend bool operator==(const Trace&, const Trace&) = default;
  } trace;

  struct Gcs {
    // Empty = $STORAGE_EMULATOR_HOST if set, else https://storage.googleapis.com.
    std::string endpoint;
    // Resumable upload chunk; GCS requires a multiple of 256 KiB.
    uint64_t chunk_size = uint64_t{16} << 20;  // 16 MiB
    // HTTP connections in the pool shared by all uploads (split among `loops`).
    int connections = 16;
    // Event loops that carry shard uploads and ranged reads, each on a thread
    // with its own connections: TLS costs CPU, and one thread tops out near
    // one core. The first is the manager's own loop; 1 = no extra thread.
    int loops = 2;
    // Bytes per second all uploads of the root send together (with two
    // tiers: the copies to the remote tier); 0 = no cap.
    uint64_t max_upload_bandwidth = 0;
    struct Retry {
      int max_attempts = 6;  // including the first; 1 = no retry
      std::chrono::milliseconds initial_backoff{200};
      std::chrono::milliseconds max_backoff{10000};
      // For one object, all attempts together. A metadata request (list,
      // stat, delete, small reads and uploads, token fetches) ends by then
      // even if the endpoint never answers; a data transfer stops retrying.
      std::chrono::milliseconds deadline{300000};
      friend bool operator==(const Retry&, const Retry&) = default;
    } retry;
    struct Timeouts {
      std::chrono::milliseconds connect{10000};
      // Abort an attempt that moves no bytes for this long (then retried).
      std::chrono::milliseconds stall{60000};
      friend bool operator==(const Timeouts&, const Timeouts&) = default;
    } timeouts;
    // Extra headers on every request (e.g. for a proxy). Values of
    // secret-looking headers (Authorization, ...) and values that look like
    // credentials ("Bearer ...", "ya29.", long tokens) are redacted when
    // printed.
    std::map<std::string, std::string> headers;
    // Bill requests to this project (requester-pays buckets); empty = none.
    std::string user_project;
    // "1.1" or "2".
    std::string http_version = "1.1";
    // PEM file of CA certificates to trust for https; empty = the system's.
    std::string ca_file;
    // Send credentials (an OAuth2 bearer token) to an http:// endpoint.
    // Off: anyone on the path could read the token and use it for an hour,
    // so a plain-http endpoint gets a request only when it is an emulator
    // (STORAGE_EMULATOR_HOST, which needs no credentials) or this is set.
    bool allow_http_credentials = false;
    friend bool operator==(const Gcs&, const Gcs&) = default;
  } gcs;

  struct Preemption {
    // Save and exit on SIGTERM (as preemptible VMs receive before shutdown).
    bool on_sigterm = false;
    // Time the final save may take after SIGTERM.
    std::chrono::milliseconds grace{30000};
    friend bool operator==(const Preemption&, const Preemption&) = default;
  } preemption;

  struct MultiHost {
    // This process's place among the processes that write one checkpoint
    // together (each its own part of the state; process 0 commits).
    int process_index = 0;
    int process_count = 1;
    // How the processes wait for each other: "auto" (the Barrier given to
    // CheckpointManager::Open if any, else "storage"), "storage" (poll the
    // checkpoint's location for the other processes' fragments and for the
    // commit), or "callback" (the Barrier given to Open; e.g. MPI).
    std::string barrier = "auto";
    // A barrier that does not complete in this time fails the save.
    std::chrono::milliseconds timeout{300000};
    friend bool operator==(const MultiHost&, const MultiHost&) = default;
  } multihost;

  // Two tiers: the root given to Open is the local tier (commits as fast as
  // its disk); every committed step that is a multiple of remote_every is
  // then copied in the background to `remote` (gs://bucket/prefix or a
  // directory), which commits it with its own manifest-last protocol and
  // keeps its own remote_keep / remote_keep_every. Reads take the newest
  // step of either tier, local first (remote if the local copy is damaged).
  struct Tiers {
    std::string remote;  // empty: one tier
    int64_t remote_every = 1;
    int remote_keep = 3;  // 0 keeps all
    int64_t remote_keep_every = 0;
    // At open, if the remote tier has a newer step than the local one (a new
    // machine with an empty disk), copy it into the local tier in the
    // background.
    bool seed_local = false;
    friend bool operator==(const Tiers&, const Tiers&) = default;
  } tiers;

  friend bool operator==(const Options&, const Options&) = default;
};

}  // namespace ckptio
