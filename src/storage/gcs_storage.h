#pragma once
// GcsStorage: checkpoints as objects in a Google Cloud Storage bucket.
//
//   gs://bucket/prefix/checkpoint_200/shard-00000.safetensors
//   gs://bucket/prefix/checkpoint_200/manifest.json     the commit point
//
// Commit protocol: the shards are uploaded in place (resumable uploads, in
// parallel over the connection pool), then the manifest is written last with
// ifGenerationMatch=0. A checkpoint exists iff its manifest does, so a crash
// leaves shard objects without a manifest: debris that recovery deletes once
// a newer step has committed (an unfinished newer step may still be in
// flight elsewhere). Removal deletes the manifest first (the checkpoint
// disappears at once), then the shards.
//
// There is no writer lock on GCS: one process writes a prefix at a time
// (multi-host saves coordinate through their own barrier).
//
// Credentials and endpoint: STORAGE_EMULATOR_HOST (an emulator, no
// credentials), else gcs.endpoint (default https://storage.googleapis.com)
// with credentials from the environment (gcs/auth.h).

#include <memory>
#include <string>

#include "ckptio/options.h"
#include "runtime/loop.h"
#include "storage/storage.h"

namespace ckptio::storage {

// Opens gs://bucket/prefix. Fails if the URL is malformed or no credentials
// can be set up; the bucket itself is first touched by the first request.
Task<Result<std::unique_ptr<Storage>>> OpenGcsStorage(runtime::Loop& loop, std::string url, Options::Gcs options);

}  // namespace ckptio::storage
