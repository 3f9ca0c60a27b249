#pragma once
// gs:// URLs and the percent-encoding of object names in JSON API URLs.

#include <string>
#include <string_view>

#include "ckptio/status.h"

namespace ckptio::gcs {

struct GcsPath {
  std::string bucket;
  std::string prefix;  // without leading or trailing '/'; may be empty
};

// "gs://bucket/some/prefix/" -> {"bucket", "some/prefix"}. InvalidArgument
// naming the URL for anything else (no bucket, a bucket name GCS would
// refuse, "." or ".." path segments).
Result<GcsPath> ParseGcsUrl(std::string_view url);

// Percent-encodes every byte except A-Z a-z 0-9 - . _ ~ (so '/' becomes %2F,
// as object names in JSON API paths require).
std::string UrlEncode(std::string_view s);

}  // namespace ckptio::gcs
