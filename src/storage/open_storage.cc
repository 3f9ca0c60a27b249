#include "storage/open_storage.h"

#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <climits>

#include "base/status_macros.h"
#include "gcs/gcs_url.h"
#include "storage/gcs_storage.h"
#include "storage/local_storage.h"

namespace ckptio::storage {
namespace {

constexpr std::string_view kAccepted =
    "a root is a local path (/data/ckpt, ./ckpt, file:///data/ckpt) or gs://BUCKET[/PREFIX]";

// The length of a leading URL scheme ("s3" in "s3://b"), or 0 if there is none:
// a letter, then letters, digits, '+', '-' or '.', then ':'.
size_t SchemeLength(std::string_view text) {
  if (text.empty() || !std::isalpha(static_cast<unsigned char>(text[0]))) return 0;
  for (size_t i = 1; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c == ':') return i;
    if (!std::isalnum(c) && c != '+' && c != '-' && c != '.') return 0;
  }
  return 0;
}

// `path` without "." segments, repeated and trailing slashes; ".." stays (a
// symlinked directory makes "a/link/.." something else than "a").
std::string Tidy(std::string_view path) {
  std::string out = path.starts_with('/') ? "/" : "";
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find('/', start);
    if (end == std::string_view::npos) end = path.size();
    std::string_view seg = path.substr(start, end - start);
    if (!seg.empty() && seg != ".") {
      if (!out.empty() && out.back() != '/') out += '/';
      out += seg;
    }
    start = end + 1;
  }
  return out.empty() ? "." : out;
}

Result<std::string> Absolute(std::string_view path) {
  if (path.starts_with('/')) return Tidy(path);
  char cwd[PATH_MAX];
  if (::getcwd(cwd, sizeof cwd) == nullptr) {
    return ErrnoToStatus(errno, "cannot resolve the relative checkpoint root \"" + std::string(path) +
                                    "\": the working directory");
  }
  return Tidy(std::string(cwd) + "/" + std::string(path));
}

}  // namespace

Result<RootUrl> ParseRootUrl(std::string_view text) {
  auto bad = [&](std::string_view why, bool local_hint = false) {
    std::string msg = "bad checkpoint root \"" + std::string(text) + "\": " + std::string(why) + "; " +
                      std::string(kAccepted);
    if (local_hint) msg += " (for a local directory of that name, write ./" + std::string(text) + ")";
    return InvalidArgumentError(std::move(msg));
  };
  if (text.empty()) return bad("it is empty");
  if (text.find('\0') != std::string_view::npos) return bad("it contains a NUL byte");
  if (text.starts_with("gs://")) {
    auto gcs = gcs::ParseGcsUrl(text);
    if (!gcs.ok()) {
      std::string why = gcs.status().message();  // "bad GCS URL \"...\": why": the URL is named already
      const std::string named = "bad GCS URL \"" + std::string(text) + "\": ";
      if (why.starts_with(named)) why.erase(0, named.size());
      return bad(why);
    }
    return RootUrl{RootUrl::Kind::kGcs, "gs://" + gcs->bucket + (gcs->prefix.empty() ? "" : "/" + gcs->prefix)};
  }
  if (text.starts_with("file://")) {
    std::string_view path = text.substr(7);
    if (!path.starts_with('/')) return bad("a file:// URL names an absolute path: file:///data/ckpt");
    return RootUrl{RootUrl::Kind::kLocal, Tidy(path)};
  }
  if (size_t n = SchemeLength(text); n > 0) {
    const std::string scheme(text.substr(0, n));
    if (scheme == "gs" || scheme == "file") return bad("a malformed " + scheme + ":// URL", /*local_hint=*/true);
    return bad("\"" + scheme + ":\" is not a storage ckptio knows", /*local_hint=*/true);
  }
  ASSIGN_OR_RETURN(std::string path, Absolute(text));
  return RootUrl{RootUrl::Kind::kLocal, std::move(path)};
}

Task<Result<std::unique_ptr<Storage>>> OpenStorage(runtime::Loop& loop, runtime::CpuPool& pool, RootUrl root,
                                                   Options options, bool create) {
  if (root.kind == RootUrl::Kind::kGcs) co_return co_await OpenGcsStorage(loop, std::move(root.path), options.gcs);
  LocalOptions local{options.io.direct, options.io.block_size, options.io.queue_depth, options.io.recycle};
  co_return co_await OpenLocalStorage(loop, pool, std::move(root.path), local, create);
}

}  // namespace ckptio::storage
