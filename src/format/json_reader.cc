#include "format/json_reader.h"

#include <functional>
#include <limits>
#include <unordered_set>

#include "base/status_macros.h"
#include "format/validate.h"

namespace ckptio::format {
namespace {

constexpr size_t kMaxParseMessageBytes = 200;

// Thrown from the parser callback to stop parsing at once; caught in
// ParseUntrustedJson and never seen outside it.
struct JsonRejected {
  std::string problem;
};

// nlohmann's messages quote the last token read, which is hostile input:
// drop the "[json.exception.parse_error.101] " tag, cut it short and keep it
// printable ASCII so it cannot forge a log line.
std::string SanitizeParseMessage(std::string_view what) {
  if (!what.empty() && what.front() == '[') {
    const size_t close = what.find("] ");
    if (close != std::string_view::npos) what.remove_prefix(close + 2);
  }
  std::string out;
  for (char c : what.substr(0, kMaxParseMessageBytes)) {
    const auto u = static_cast<unsigned char>(c);
    out += (u < 0x20 || u >= 0x7F) ? '?' : c;
  }
  if (what.size() > kMaxParseMessageBytes) out += "...";
  return out;
}

// Tracks the keys of every open object to catch duplicates, and the depth.
class StrictCallback {
 public:
  bool operator()(int depth, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
      case Json::parse_event_t::array_start:
        if (depth >= kMaxJsonDepth) {
          throw JsonRejected{"nests deeper than " + std::to_string(kMaxJsonDepth) + " levels"};
        }
        if (event == Json::parse_event_t::object_start) open_keys_.emplace_back();
        break;
      case Json::parse_event_t::object_end:
        open_keys_.pop_back();
        break;
      case Json::parse_event_t::key: {
        const auto& key = parsed.get_ref<const std::string&>();
        if (!open_keys_.back().insert(key).second) {
          throw JsonRejected{"has the key " + Quoted(key) + " twice in one object"};
        }
        break;
      }
      default:
        break;
    }
    return true;
  }

 private:
  std::vector<std::unordered_set<std::string>> open_keys_;
};

}  // namespace

Result<Json> ParseUntrustedJson(std::string_view file, std::string_view what,
                                std::string_view bytes) {
  const std::string context = std::string(file) + ": " + std::string(what);
  try {
    StrictCallback callback;
    return Json::parse(bytes.begin(), bytes.end(), std::ref(callback));
  } catch (const JsonRejected& e) {
    return CorruptionError(context + " " + e.problem);
  } catch (const Json::exception& e) {
    return CorruptionError(context + " is not valid JSON: " + SanitizeParseMessage(e.what()));
  }
}

Status FieldReader::Error(std::string_view problem) const {
  return CorruptionError(context_ + ": " + std::string(problem));
}

Status FieldReader::CheckKeys(std::initializer_list<std::string_view> allowed) const {
  return CheckKeys(std::span<const std::string_view>(allowed.begin(), allowed.size()));
}

Status FieldReader::CheckKeys(std::span<const std::string_view> allowed) const {
  for (const auto& [key, value] : obj_.items()) {
    bool known = false;
    for (std::string_view a : allowed) known = known || key == a;
    if (!known) return Error("unknown field " + Quoted(key));
  }
  return Status::Ok();
}

Result<const Json*> FieldReader::Find(std::string_view key) const {
  auto it = obj_.find(key);
  if (it == obj_.end()) return Error("missing field " + Quoted(key));
  return &*it;
}

Status FieldReader::WrongType(std::string_view key, std::string_view expected) const {
  return Error("field " + Quoted(key) + " must be " + std::string(expected));
}

Result<uint64_t> FieldReader::U64(std::string_view key) const {
  ASSIGN_OR_RETURN(const Json* v, Find(key));
  if (!v->is_number_unsigned()) return WrongType(key, "an unsigned integer");
  return v->get<uint64_t>();
}

Result<int64_t> FieldReader::I64(std::string_view key) const {
  ASSIGN_OR_RETURN(const Json* v, Find(key));
  if (v->is_number_integer() && !v->is_number_unsigned()) return v->get<int64_t>();
  if (v->is_number_unsigned() &&
      v->get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return static_cast<int64_t>(v->get<uint64_t>());
  }
  return WrongType(key, "a 64-bit integer");
}

Result<std::string> FieldReader::String(std::string_view key) const {
  ASSIGN_OR_RETURN(const Json* v, Find(key));
  if (!v->is_string()) return WrongType(key, "a string");
  return v->get<std::string>();
}

Result<std::vector<uint64_t>> FieldReader::U64Array(std::string_view key) const {
  ASSIGN_OR_RETURN(const Json* v, Find(key));
  if (!v->is_array()) return WrongType(key, "an array of unsigned integers");
  std::vector<uint64_t> out;
  out.reserve(v->size());
  for (const Json& e : *v) {
    if (!e.is_number_unsigned()) return WrongType(key, "an array of unsigned integers");
    out.push_back(e.get<uint64_t>());
  }
  return out;
}

Result<const Json*> FieldReader::Array(std::string_view key) const {
  ASSIGN_OR_RETURN(const Json* v, Find(key));
  if (!v->is_array()) return WrongType(key, "an array");
  return v;
}

Result<const Json*> FieldReader::Object(std::string_view key) const {
  ASSIGN_OR_RETURN(const Json* v, Find(key));
  if (!v->is_object()) return WrongType(key, "an object");
  return v;
}

}  // namespace ckptio::format
