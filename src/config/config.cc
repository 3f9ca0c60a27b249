#include "config/config.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "base/status_macros.h"
#include "base/text.h"
#include "config/knobs.h"
#include "base/unique_fd.h"

namespace ckptio::config {
namespace {

using json = nlohmann::ordered_json;

// A config file is a few KiB; anything much larger is the wrong file (or
// /dev/zero), and reading it whole would only delay the error.
constexpr size_t kMaxConfigBytes = size_t{1} << 20;

// No knob nests deeper than 3 levels ("gcs": {"retry": {...}}). Deeper JSON is
// refused while it is parsed: a value such as {"snapshot": [[[[...]]]]} would
// otherwise reach code that recurses on it (the enum check dumps it) and
// overflow the stack (found by tests/fuzz/fuzz_config).
constexpr int kMaxConfigDepth = 32;

// Thrown from the parser callback to stop at the first level too deep.
struct TooDeep {};

std::string FilePrefix(std::string_view source) {
  return source.empty() ? std::string("config") : "config " + std::string(source);
}

Status KeyError(std::string_view source, std::string_view path, const Status& cause) {
  return InvalidArgumentError(FilePrefix(source) + ": key " + base::Quoted(path) + ": " +
                              cause.message());
}

std::string_view Parent(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : path.substr(0, dot);
}

std::string_view Leaf(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

// Lower case with '-' read as '_', so "Block-Size" is close to "block_size".
std::string Normalize(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = c == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The knob the writer of an unknown key most likely meant: a sibling a few
// edits away ("io.blocksize"), else a knob of the same name in another group
// ("block_size" at the top level). Empty if nothing is convincing.
std::string_view Suggest(std::string_view path) {
  const std::string leaf = Normalize(Leaf(path));
  const std::string_view parent = Parent(path);
  const size_t threshold = std::clamp<size_t>(leaf.size() / 3, 1, 3);
  std::string_view best;
  size_t best_distance = threshold + 1;
  for (const Knob& k : Knobs()) {
    if (Parent(k.path) != parent) continue;
    const size_t d = EditDistance(leaf, Leaf(k.path));
    if (d < best_distance) {
      best = k.path;
      best_distance = d;
    }
  }
  if (!best.empty()) return best;
  for (const Knob& k : Knobs()) {
    if (Leaf(k.path) == leaf) return k.path;
  }
  return {};
}

Status UnknownKey(std::string_view source, std::string_view path) {
  std::string m = FilePrefix(source) + ": unknown key " + base::Quoted(path);
  if (std::string_view guess = Suggest(path); !guess.empty()) {
    return InvalidArgumentError(m + " (did you mean " + base::Quoted(guess) + "?)");
  }
  const std::string_view parent = Parent(path);
  m += parent.empty() ? std::string("; the top-level keys are: ")
                      : "; the keys in " + base::Quoted(parent) + " are: ";
  bool first = true;
  for (const Knob& k : Knobs()) {
    if (Parent(k.path) != parent) continue;
    m += (first ? "" : ", ") + std::string(Leaf(k.path));
    first = false;
  }
  return InvalidArgumentError(m);
}

// Applies one JSON object (the file's top level, or a group) to `options`.
Status ApplyObject(const json& object, std::string_view parent, std::string_view source,
                   Options& options) {
  for (const auto& [key, value] : object.items()) {
    const std::string path = parent.empty() ? key : std::string(parent) + "." + key;
    if (key.find('.') != std::string::npos) {
      // A dotted key would otherwise look up the same knob as its nested
      // form and make {"io.block_size": ...} and {"io": {"block_size": ...}}
      // two spellings that can silently override each other.
      return InvalidArgumentError(FilePrefix(source) + ": key " + base::Quoted(path) +
                                  ": dotted keys are not supported; nest objects instead, "
                                  "as in {\"io\": {\"block_size\": \"4MiB\"}}");
    }
    const Knob* knob = FindKnob(path);
    if (knob == nullptr) return UnknownKey(source, path);
    if (knob->is_group()) {
      if (!value.is_object()) {
        return KeyError(source, path,
                        InvalidArgumentError("expected an object, got " + DescribeJson(value)));
      }
      RETURN_IF_ERROR(ApplyObject(value, path, source, options));
      continue;
    }
    if (Status s = ParseKnob(*knob, value, options); !s.ok()) return KeyError(source, path, s);
  }
  return Status::Ok();
}

// nlohmann keeps the last of two equal keys without a word. In a config that
// hides a mistake (two edits of the same knob), so the parser callback
// records the first repeated key path instead.
class DuplicateKeyFinder {
 public:
  bool OnEvent(json::parse_event_t event, const json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: frames_.push_back({true, {}, {}}); break;
      case json::parse_event_t::array_start: frames_.push_back({false, {}, "[]"}); break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!frames_.empty()) frames_.pop_back();
        break;
      case json::parse_event_t::key: {
        if (frames_.empty()) break;
        Frame& top = frames_.back();
        top.key = parsed.get<std::string>();
        if (!top.keys.insert(top.key).second && duplicate_.empty()) duplicate_ = CurrentPath();
        break;
      }
      case json::parse_event_t::value: break;
    }
    return true;  // keep everything; this only observes
  }

  // The first key that appeared twice in one object, as a path; empty if none.
  const std::string& duplicate() const { return duplicate_; }

 private:
  struct Frame {
    bool is_object;
    std::set<std::string> keys;
    std::string key;  // the key being parsed in this object
  };

  std::string CurrentPath() const {
    std::string path;
    for (const Frame& f : frames_) path += (path.empty() || !f.is_object ? "" : ".") + f.key;
    return path;
  }

  std::vector<Frame> frames_;
  std::string duplicate_;
};

Status ReadWholeFile(const std::string& path, std::string& out) {
  base::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) return ErrnoToStatus(errno, "cannot open config file", path);
  out.clear();
  char buf[16384];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoToStatus(errno, "cannot read config file", path);
    if (n == 0) return Status::Ok();
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > kMaxConfigBytes) {
      return InvalidArgumentError("config " + path + ": larger than " +
                                  FormatSize(kMaxConfigBytes) + "; is this a config file?");
    }
  }
}

std::string RenderDocument(const Options& options, bool comments, bool redact) {
  std::string out;
  if (comments) {
    out +=
        "// ckptio configuration: every knob with its default value.\n"
        "// JSON with comments. Give a file like this with --config FILE or $CKPTIO_CONFIG;\n"
        "// keys left out keep their defaults, unknown keys are errors.\n"
        "// Sizes: a number of bytes, or \"4KiB\", \"256MiB\", \"1GiB\" (1024-based), "
        "\"16MB\" (1000-based).\n"
        "// Durations: a number of seconds, or \"250ms\", \"30s\", \"2m\", \"1h\".\n";
  }
  out += "{";
  // The table lists a group's rows right after the group, so a stack of open
  // groups is all the structure needed.
  std::vector<std::string_view> open;
  std::vector<bool> has_items = {false};
  auto indent = [&] { return std::string(2 * open.size() + 2, ' '); };
  auto close_group = [&] {
    open.pop_back();
    has_items.pop_back();
    out += "\n" + indent() + "}";
  };
  for (const Knob& knob : Knobs()) {
    while (!open.empty() && open.back() != Parent(knob.path)) close_group();
    out += has_items.back() ? ",\n" : "\n";
    has_items.back() = true;
    if (comments) {
      out += indent() + "// " + std::string(knob.description);
      if (!knob.is_group()) out += " [" + DescribeType(knob) + "]";
      out += "\n";
    }
    out += indent() + json(std::string(Leaf(knob.path))).dump() + ": ";
    if (knob.is_group()) {
      out += "{";
      open.push_back(knob.path);
      has_items.push_back(false);
    } else {
      out += RenderKnob(knob, options, redact);
    }
  }
  while (!open.empty()) close_group();
  out += "\n}\n";
  return out;
}

}  // namespace

Result<Options> ParseConfig(std::string_view text, std::string_view source) {
  DuplicateKeyFinder duplicates;
  json document;
  try {
    document = json::parse(
        text.begin(), text.end(),
        [&duplicates](int depth, json::parse_event_t event, json& parsed) {
          const bool opens = event == json::parse_event_t::object_start ||
                             event == json::parse_event_t::array_start;
          if (opens && depth >= kMaxConfigDepth) throw TooDeep{};
          return duplicates.OnEvent(event, parsed);
        },
        /*allow_exceptions=*/true, /*ignore_comments=*/true);
  } catch (const TooDeep&) {
    return InvalidArgumentError(FilePrefix(source) + ": invalid JSON: nests deeper than " +
                                std::to_string(kMaxConfigDepth) + " levels");
  } catch (const json::exception& e) {
    // what() is "[json.exception.parse_error.101] parse error at line 3,
    // column 5: ..."; the bracketed id means nothing to the reader.
    std::string_view what = e.what();
    if (const size_t end = what.find("] "); what.starts_with("[") && end != what.npos) {
      what.remove_prefix(end + 2);
    }
    return InvalidArgumentError(FilePrefix(source) + ": invalid JSON: " + std::string(what));
  }
  if (!duplicates.duplicate().empty()) {
    return InvalidArgumentError(FilePrefix(source) + ": key " + base::Quoted(duplicates.duplicate()) +
                                " is set twice");
  }
  if (!document.is_object()) {
    return InvalidArgumentError(FilePrefix(source) +
                                ": expected a JSON object ({...}) at the top level, got " +
                                std::string(document.type_name()));
  }
  Options options;
  RETURN_IF_ERROR(ApplyObject(document, "", source, options));
  if (Status s = ValidateOptions(options); !s.ok()) {
    return InvalidArgumentError(FilePrefix(source) + ": " + s.message());
  }
  return options;
}

Status ValidateOptions(const Options& options) {
  for (const Knob& knob : Knobs()) {
    if (Status s = CheckKnob(knob, options); !s.ok()) {
      return InvalidArgumentError("key " + base::Quoted(knob.path) + ": " + s.message());
    }
  }
  if (options.incremental && options.overwrite) {
    return InvalidArgumentError(
        "key \"incremental\": cannot be combined with overwrite (replacing a step would delete the "
        "shards later steps refer to)");
  }
  const auto& retry = options.gcs.retry;
  if (retry.initial_backoff > retry.max_backoff) {
    return InvalidArgumentError(
        "key \"gcs.retry.initial_backoff\": must not exceed gcs.retry.max_backoff (" +
        FormatDuration(retry.max_backoff) + "), got " + FormatDuration(retry.initial_backoff));
  }
  return Status::Ok();
}

Result<Options> LoadConfigFile(const std::string& path) {
  std::string text;
  RETURN_IF_ERROR(ReadWholeFile(path, text));
  return ParseConfig(text, path);
}

Result<Options> LoadConfig(const std::string& path_or_empty) {
  if (!path_or_empty.empty()) return LoadConfigFile(path_or_empty);
  const char* from_env = std::getenv(kConfigEnv);
  if (from_env == nullptr || *from_env == '\0') return Options{};
  Result<Options> options = LoadConfigFile(from_env);
  if (!options.ok()) {
    return options.status().WithContext(std::string("file named by $") + kConfigEnv);
  }
  return options;
}

std::string DefaultsDocument() { return RenderDocument(Options{}, /*comments=*/true, /*redact=*/false); }

std::string ToJson(const Options& options) {
  return RenderDocument(options, /*comments=*/false, /*redact=*/true);
}

}  // namespace ckptio::config
