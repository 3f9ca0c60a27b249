#include "format/validate.h"

#include <cstdint>

namespace ckptio::format {
namespace {

constexpr size_t kMaxShardNameBytes = 255;

bool HasDotDotComponent(std::string_view name) {
  size_t start = 0;
  while (start <= name.size()) {
    size_t slash = name.find('/', start);
    if (slash == std::string_view::npos) slash = name.size();
    if (name.substr(start, slash - start) == "..") return true;
    start = slash + 1;
  }
  return false;
}

bool IsShardNameChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
         c == '.' || c == '_' || c == '-';
}

}  // namespace

Status CheckTensorName(std::string_view name) {
  const std::string what = "tensor name " + Quoted(name);
  if (name.empty()) return InvalidArgumentError("tensor name is empty");
  if (name.find('\0') != std::string_view::npos) {
    return InvalidArgumentError(what + " contains a NUL byte");
  }
  if (!IsValidUtf8(name)) return InvalidArgumentError(what + " is not valid UTF-8");
  if (name.front() == '/') return InvalidArgumentError(what + " is an absolute path");
  if (HasDotDotComponent(name)) {
    return InvalidArgumentError(what + " contains a \"..\" path component");
  }
  if (name == "__metadata__") return InvalidArgumentError(what + " is reserved by safetensors");
  return Status::Ok();
}

Status CheckShardFileName(std::string_view name) {
  const std::string what = "shard name " + Quoted(name);
  if (name.empty()) return InvalidArgumentError("shard name is empty");
  if (name.size() > kMaxShardNameBytes) {
    return InvalidArgumentError(what + " is longer than 255 characters");
  }
  for (char c : name) {
    if (!IsShardNameChar(c)) {
      return InvalidArgumentError(what +
                                  " is not a plain file name (only A-Z a-z 0-9 . _ - allowed)");
    }
  }
  if (name == "." || name == "..") return InvalidArgumentError(what + " is not a plain file name");
  return Status::Ok();
}

Status AsCorruption(std::string_view context, const Status& status) {
  std::string message(context);
  message += ": ";
  message += status.message();
  return CorruptionError(std::move(message));
}

}  // namespace ckptio::format
