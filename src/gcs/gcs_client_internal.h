#pragma once
// What gcs_client.cc and gcs_upload.cc share; not part of GcsClient's API.

#include <string>

#include "ckptio/status.h"
#include "gcs/gcs_client.h"
#include "gcs/retry.h"
#include "http/http_client.h"

namespace ckptio::gcs::internal {

// An object resource from a JSON answer's body; Unavailable naming `what`
// when the body is not one (a broken stream, a proxy's page).
Result<ObjectMeta> ParseObjectBody(const http::Response& r, const std::string& what);

// The last error, with how long we tried: "... (gave up after 6 attempts ...)".
Status GaveUp(Status last, const Backoff& backoff);

}  // namespace ckptio::gcs::internal
