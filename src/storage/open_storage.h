#pragma once
// From what the user typed as a checkpoint root to the Storage that holds it.
//
// Accepted roots: a local path (`/data/ckpt`, `ckpt`, `./ckpt`), the same as
// `file:///data/ckpt`, or `gs://bucket[/prefix]` with a bucket name GCS
// accepts. Anything else that looks like a URL (`scheme:` or `scheme://`,
// e.g. `gcs://b/run`, `s3://b/run`, `gs:/b/run`, a bare `gs://`) is an error
// naming the accepted forms: saved to the local disk, it would have made a
// directory named `gcs:` in the working directory and reported success. A
// local path that really starts with such text is written `./gcs:/...`.

#include <memory>
#include <string>
#include <string_view>

#include "ckptio/options.h"
#include "ckptio/status.h"
#include "runtime/task.h"
#include "runtime/cpu_pool.h"
#include "runtime/loop.h"
#include "storage/storage.h"

namespace ckptio::storage {

struct RootUrl {
  enum class Kind { kLocal, kGcs };
  Kind kind = Kind::kLocal;
  // kLocal: an absolute path without a trailing '/' (relative paths are
  // taken from the working directory at parse time, so messages name the
  // absolute path). kGcs: "gs://bucket" or "gs://bucket/prefix".
  std::string path;
};

// Parses a root as above; InvalidArgument naming the input and the accepted
// forms for anything else (empty, an unknown or malformed scheme, a bad
// bucket name or a "." / ".." segment in a gs:// prefix).
Result<RootUrl> ParseRootUrl(std::string_view text);

// Opens the storage of `root` on `loop` (its files' CPU work on `pool`):
// local roots are created (with their parents) if `create`, else must exist.
Task<Result<std::unique_ptr<Storage>>> OpenStorage(runtime::Loop& loop, runtime::CpuPool& pool, RootUrl root,
                                                   Options options, bool create);

}  // namespace ckptio::storage
