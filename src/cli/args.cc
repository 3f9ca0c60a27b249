#include "cli/args.h"

#include <algorithm>
#include <charconv>

#include "base/status_macros.h"
#include "config/units.h"

namespace ckptio::cli {
namespace {

bool IsHelp(std::string_view a) { return a == "--help" || a == "-h"; }

// Every subcommand reads the config file; declaring it once here keeps the
// flag spelled the same everywhere.
constexpr const char* kConfigFlag = "config";

}  // namespace

Result<int64_t> ParseInt(std::string_view text) {
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec == std::errc::result_out_of_range) {
    return InvalidArgumentError("expected an integer, got \"" + std::string(text) + "\"" +
                                (text.empty() ? "" : " (out of range)"));
  }
  if (ec != std::errc() || p != end) {
    return InvalidArgumentError("expected an integer, got \"" + std::string(text) + "\"");
  }
  return v;
}

ArgParser::ArgParser(std::string command, std::string synopsis, std::string summary, std::string program)
    : command_(std::move(command)), program_(std::move(program)), synopsis_(std::move(synopsis)),
      summary_(std::move(summary)) {
  Flag(kConfigFlag, "FILE", "config file (default: $CKPTIO_CONFIG, else built-in defaults)");
}

ArgParser& ArgParser::Positional(std::string name, std::string help) {
  positionals_.push_back({std::move(name), std::move(help)});
  return *this;
}

ArgParser& ArgParser::Flag(std::string name, std::string value_name, std::string help, Arity arity) {
  flags_.push_back({std::move(name), std::move(value_name), std::move(help), arity});
  return *this;
}

ArgParser& ArgParser::Switch(std::string name, std::string help) {
  flags_.push_back({std::move(name), "", std::move(help), Arity::kOptional});
  return *this;
}

const ArgParser::FlagSpec* ArgParser::FindFlag(std::string_view name) const {
  for (const FlagSpec& f : flags_) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

Status ArgParser::Error(const std::string& what) const {
  const std::string invoked = command_.empty() ? program_ : program_ + " " + command_;
  return InvalidArgumentError((command_.empty() ? program_ : command_) + ": " + what + " (see: " + invoked +
                              " --help)");
}

// Consumes the flag at argv[*i] (and its value), advancing *i past it.
Status ArgParser::TakeFlag(std::span<const std::string> argv, size_t* i, Args* out) const {
  std::string_view arg = argv[*i];
  std::string_view name = arg.substr(2);
  std::optional<std::string> value;
  if (size_t eq = name.find('='); eq != std::string_view::npos) {
    value = std::string(name.substr(eq + 1));
    name = name.substr(0, eq);
  }
  const FlagSpec* spec = FindFlag(name);
  if (spec == nullptr) return Error("unknown flag --" + std::string(name));
  if (spec->value_name.empty()) {
    if (value) return Error("--" + spec->name + " takes no value");
    value = "";
  } else if (!value) {
    if (*i + 1 >= argv.size()) return Error("--" + spec->name + " needs a value (" + spec->value_name + ")");
    value = argv[++*i];
  }
  std::vector<std::string>& values = out->flags_[spec->name];
  if (!spec->repeated() && !values.empty()) return Error("--" + spec->name + " given more than once");
  values.push_back(std::move(*value));
  ++*i;
  return Status::Ok();
}

Result<Args> ArgParser::Parse(std::span<const std::string> argv) const {
  Args out;
  // --help first: it must work whatever else is wrong on the line.
  for (const std::string& a : argv) {
    if (a == "--") break;
    if (IsHelp(a)) {
      out.help_ = true;
      return out;
    }
  }
  bool flags_done = false;
  for (size_t i = 0; i < argv.size();) {
    const std::string& a = argv[i];
    if (!flags_done && a == "--") {
      flags_done = true;
      ++i;
    } else if (!flags_done && a.size() > 2 && a.compare(0, 2, "--") == 0) {
      RETURN_IF_ERROR(TakeFlag(argv, &i, &out));
    } else if (!flags_done && a.size() > 1 && a[0] == '-') {
      return Error("unknown flag " + a);
    } else {
      if (out.positionals_.size() >= positionals_.size()) return Error("unexpected argument \"" + a + "\"");
      out.positionals_.push_back(a);
      ++i;
    }
  }
  if (out.positionals_.size() < positionals_.size()) {
    return Error("missing " + positionals_[out.positionals_.size()].name);
  }
  for (const FlagSpec& f : flags_) {
    if (f.required() && !out.Has(f.name)) return Error(f.Spelling() + " is required");
  }
  return out;
}

std::string ArgParser::Usage() const {
  std::string u = command_.empty() ? program_ : program_ + " " + command_;
  if (!synopsis_.empty()) u += " " + synopsis_;
  for (const FlagSpec& f : flags_) {
    if (f.required()) u += " " + f.Spelling() + (f.repeated() ? "..." : "");
  }
  for (const FlagSpec& f : flags_) {
    if (f.required() || f.name == kConfigFlag) continue;  // --config: in the help below
    u += " [" + f.Spelling() + "]" + (f.repeated() ? "..." : "");
  }
  return u;
}

std::string ArgParser::Help() const {
  std::string h = "usage: " + Usage() + "\n\n" + summary_ + "\n";
  std::vector<std::pair<std::string, std::string>> rows;
  for (const PositionalSpec& p : positionals_) rows.emplace_back(p.name, p.help);
  for (const FlagSpec& f : flags_) {
    rows.emplace_back(f.Spelling(), f.help + (f.repeated() ? " (repeatable)" : ""));
  }
  rows.emplace_back("--help", "show this help");
  size_t width = 0;
  for (const auto& r : rows) width = std::max(width, r.first.size());
  h += "\n";
  for (const auto& [left, right] : rows) {
    h += "  " + left + std::string(width - left.size() + 2, ' ') + right + "\n";
  }
  return h;
}

bool Args::Has(std::string_view flag) const { return flags_.find(flag) != flags_.end(); }

std::optional<std::string> Args::Get(std::string_view flag) const {
  auto it = flags_.find(flag);
  if (it == flags_.end() || it->second.empty()) return std::nullopt;
  return it->second.back();
}

std::vector<std::string> Args::GetAll(std::string_view flag) const {
  auto it = flags_.find(flag);
  return it == flags_.end() ? std::vector<std::string>{} : it->second;
}

Result<std::optional<int64_t>> Args::GetInt(std::string_view flag, int64_t min, int64_t max) const {
  std::optional<std::string> text = Get(flag);
  if (!text) return std::optional<int64_t>();
  auto v = ParseInt(*text);
  if (!v.ok()) return v.status().WithContext("--" + std::string(flag));
  if (*v < min || *v > max) {
    return InvalidArgumentError("--" + std::string(flag) + ": must be in [" + std::to_string(min) + ", " +
                                std::to_string(max) + "], got " + *text);
  }
  return std::optional<int64_t>(*v);
}

Result<std::optional<uint64_t>> Args::GetSize(std::string_view flag) const {
  std::optional<std::string> text = Get(flag);
  if (!text) return std::optional<uint64_t>();
  auto v = config::ParseSize(*text);
  if (!v.ok()) return v.status().WithContext("--" + std::string(flag));
  return std::optional<uint64_t>(*v);
}

Result<std::optional<std::chrono::nanoseconds>> Args::GetDuration(std::string_view flag) const {
  std::optional<std::string> text = Get(flag);
  if (!text) return std::optional<std::chrono::nanoseconds>();
  auto v = config::ParseDuration(*text);
  if (!v.ok()) return v.status().WithContext("--" + std::string(flag));
  return std::optional<std::chrono::nanoseconds>(*v);
}

}  // namespace ckptio::cli
