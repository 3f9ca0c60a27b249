#pragma once
// ArgParser: the one command-line parser every `ckptio` subcommand uses.
//
//   ArgParser p("ls", "ROOT", "list the committed checkpoints of ROOT");
//   p.Positional("ROOT", "checkpoint directory");
//   p.Flag("step", "N", "only this step");
//   ASSIGN_OR_RETURN(Args args, p.Parse(argv_after_subcommand));
//   if (args.help()) { fputs(p.Help().c_str(), stdout); return 0; }
//
// Accepts `--flag VALUE` and `--flag=VALUE`, switches (`--flag`), required
// and repeated flags, positionals in order, `--` to end the flags, and `--help`/`-h`
// anywhere (which wins over every other error, so `ckptio ls --help` works
// without a ROOT). `--config FILE` is accepted by every parser. Errors are
// InvalidArgument and name the subcommand and the flag.
// Pure: no I/O; any thread.

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status_macros.h"
#include "ckptio/status.h"

namespace ckptio::cli {

class Args;

class ArgParser {
 public:
  // `command` as typed after `ckptio` ("ls", "config"); `synopsis` the
  // positionals as the usage line shows them ("ROOT", "defaults|show").
  // `program`: the executable, for a program of its own (bench/seed's
  // "ckptio-seed", with an empty `command`).
  ArgParser(std::string command, std::string synopsis, std::string summary, std::string program = "ckptio");

  // How often a flag may or must appear.
  enum class Arity {
    kOptional,   // at most once
    kRequired,   // exactly once
    kRepeated,   // any number of times; values kept in order
    kOneOrMore,  // at least once; values kept in order
  };

  // A required positional argument; they are matched in declaration order.
  ArgParser& Positional(std::string name, std::string help);
  // `--name VALUE`.
  ArgParser& Flag(std::string name, std::string value_name, std::string help, Arity arity = Arity::kOptional);
  // `--name`, no value, at most once.
  ArgParser& Switch(std::string name, std::string help);

  Result<Args> Parse(std::span<const std::string> argv) const;

  // The usage line, the summary and one line per argument.
  std::string Help() const;
  // "ckptio ls ROOT [--step N] ..." (one line).
  std::string Usage() const;
  const std::string& command() const { return command_; }

 private:
  struct FlagSpec {
    std::string name;
    std::string value_name;  // empty for a switch
    std::string help;
    Arity arity = Arity::kOptional;
    bool required() const { return arity == Arity::kRequired || arity == Arity::kOneOrMore; }
    bool repeated() const { return arity == Arity::kRepeated || arity == Arity::kOneOrMore; }
    std::string Spelling() const { return "--" + name + (value_name.empty() ? "" : " " + value_name); }
  };
  struct PositionalSpec {
    std::string name;
    std::string help;
  };

  const FlagSpec* FindFlag(std::string_view name) const;
  Status Error(const std::string& what) const;
  Status TakeFlag(std::span<const std::string> argv, size_t* i, Args* out) const;

  std::string command_;
  std::string program_;
  std::string synopsis_;
  std::string summary_;
  std::vector<FlagSpec> flags_;
  std::vector<PositionalSpec> positionals_;
};

// The parsed command line. Typed getters return nullopt for an absent flag
// and InvalidArgument naming the flag for a value that does not parse.
class Args {
 public:
  bool help() const { return help_; }
  const std::vector<std::string>& positionals() const { return positionals_; }
  const std::string& positional(size_t i) const { return positionals_.at(i); }

  bool Has(std::string_view flag) const;
  // The value of a single-valued flag (the last one for a repeated flag).
  std::optional<std::string> Get(std::string_view flag) const;
  std::vector<std::string> GetAll(std::string_view flag) const;

  // An integer in [min, max].
  Result<std::optional<int64_t>> GetInt(std::string_view flag, int64_t min, int64_t max) const;
  // A byte count as config::ParseSize reads it ("64MiB").
  Result<std::optional<uint64_t>> GetSize(std::string_view flag) const;
  // A duration as config::ParseDuration reads it ("0.2s", "1s", "500ms").
  Result<std::optional<std::chrono::nanoseconds>> GetDuration(std::string_view flag) const;

 private:
  friend class ArgParser;
  bool help_ = false;
  std::vector<std::string> positionals_;
  std::map<std::string, std::vector<std::string>, std::less<>> flags_;
};

// Parses a whole decimal integer (optional leading '-'), nothing else.
Result<int64_t> ParseInt(std::string_view text);

}  // namespace ckptio::cli
