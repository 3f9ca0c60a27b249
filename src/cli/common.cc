#include "cli/common.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <limits>

#include "base/status_macros.h"
#include "config/config.h"
#include "storage/open_storage.h"

namespace ckptio::cli {

int ExitCodeFor(StatusCode code) {
  switch (code) {
    case StatusCode::kOk:
      return kExitOk;
    // The user can fix these by changing the command line, the config or
    // the input files.
    case StatusCode::kInvalidArgument:
    case StatusCode::kNotFound:
    case StatusCode::kAlreadyExists:
    case StatusCode::kFailedPrecondition:
    case StatusCode::kResourceExhausted:  // a configured bound (staging_memory) too small
    case StatusCode::kUnimplemented:      // e.g. a gs:// root in a build without GCS
      return kExitUsage;
    // The storage or the data failed.
    case StatusCode::kCorruption:
    case StatusCode::kIoError:
    case StatusCode::kNoSpace:
    case StatusCode::kPermissionDenied:
    case StatusCode::kUnavailable:
    case StatusCode::kDeadlineExceeded:
    case StatusCode::kCancelled:
    case StatusCode::kInternal:
      return kExitFailure;
  }
  return kExitFailure;
}

int Report(const Status& status) {
  if (status.ok()) return kExitOk;
  std::fflush(stdout);  // keep the order of stdout and stderr lines on a terminal
  std::fprintf(stderr, "ckptio: %s\n", status.message().c_str());
  return ExitCodeFor(status.code());
}

std::optional<int> ParseOrExit(const ArgParser& parser, std::span<const std::string> argv, Args* args) {
  auto parsed = parser.Parse(argv);
  if (!parsed.ok()) return Report(parsed.status());
  if (parsed->help()) {
    std::fputs(parser.Help().c_str(), stdout);
    return kExitOk;
  }
  *args = std::move(*parsed);
  return std::nullopt;
}

Result<Options> LoadOptions(const Args& args) { return config::LoadConfig(args.Get("config").value_or("")); }

Options ReadOnlyOptions(Options options) {
  options.staging_memory = uint64_t{1} << 20;
  options.io.register_buffers = false;
  return options;
}

Result<std::unique_ptr<CheckpointManager>> OpenExistingRoot(const std::string& root, Options options, bool read_only) {
  ASSIGN_OR_RETURN(storage::RootUrl url, storage::ParseRootUrl(root));
  if (url.kind == storage::RootUrl::Kind::kLocal) {
    const std::string& path = url.path;
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      int err = errno;
      if (err == ENOENT && !options.tiers.remote.empty()) {
        return NotFoundError("checkpoint root " + path + " does not exist (its remote tier is " +
                             options.tiers.remote + ": `ckptio ls " + options.tiers.remote + "`)");
      }
      if (err == ENOENT) return NotFoundError("checkpoint root " + path + " does not exist");
      return ErrnoToStatus(err, "cannot open checkpoint root", path);
    }
    if (!S_ISDIR(st.st_mode)) return InvalidArgumentError("checkpoint root " + path + " is not a directory");
  }
  return pipeline::OpenParsedRoot(std::move(url), std::move(options), read_only, /*barrier=*/nullptr);
}

Result<std::unique_ptr<CheckpointManager>> OpenRootForReading(const Args& args) {
  ASSIGN_OR_RETURN(Options options, LoadOptions(args));
  return OpenExistingRoot(args.positional(0), ReadOnlyOptions(std::move(options)), /*read_only=*/true);
}

Result<std::optional<int64_t>> StepFlag(const Args& args) {
  return args.GetInt("step", 0, std::numeric_limits<int64_t>::max());
}

std::string HumanBytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  if (bytes < 1024) return std::to_string(bytes) + " B";
  double v = static_cast<double>(bytes);
  size_t unit = 0;
  while (v >= 1024 && unit + 1 < std::size(kUnits)) {
    v /= 1024;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, kUnits[unit]);
  return buf;
}

std::string HumanRate(uint64_t bytes, double seconds) {
  if (seconds <= 0) return "-";
  return HumanBytes(static_cast<uint64_t>(static_cast<double>(bytes) / seconds)) + "/s";
}

std::string HumanSeconds(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, seconds < 10 ? "%.2f s" : "%.1f s", seconds);
  return buf;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool StderrIsTerminal() { return ::isatty(STDERR_FILENO) == 1; }

}  // namespace ckptio::cli
