// ckptio: the command-line tool over the checkpoint library; the only main.
//
//   ckptio [--config FILE] <command> [args]   see `ckptio --help`
//
// A --config given before the command is handed to the command, as if it
// followed it, so both spellings work.

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "http/ca_bundle.h"

namespace ckptio::cli {
namespace {

constexpr Command kCommands[] = {
    {"demo", "simulate a trainer: blocking saves vs ckptio's async saves, then ls and verify", RunDemo},
    {"save", "commit safetensors files as one checkpoint", RunSave},
    {"ls", "list the committed checkpoints of a root", RunLs},
    {"verify", "re-read checkpoints and check every CRC32C", RunVerify},
    {"export", "write one step as a single safetensors file", RunExport},
    {"rm", "delete one committed checkpoint", RunRm},
    {"prune", "delete all but the newest K checkpoints", RunPrune},
    {"config", "print the default or the effective config (defaults | show)", RunConfig},
};

void PrintTopHelp(std::FILE* out) {
  std::fputs("usage: ckptio [--config FILE] <command> [args]\n\ncommands:\n", out);
  for (const Command& c : kCommands) std::fprintf(out, "  %-8s %s\n", c.name, c.summary);
  std::fputs(
      "  help     show this list, or `ckptio help COMMAND` for one command\n"
      "\nglobal flags:\n"
      "  --config FILE  config file (default: $CKPTIO_CONFIG, else built-in defaults)\n"
      "  --help         help (after a command: that command's help)\n"
      "  --version      print the version\n"
      "\nexit status: 0 ok, 1 bad usage or bad input, 2 I/O or integrity failure\n",
      out);
}

const Command* FindCommand(const std::string& name) {
  for (const Command& c : kCommands) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

int UnknownCommand(const std::string& name) {
  return Report(InvalidArgumentError("unknown command \"" + name + "\" (see: ckptio --help)"));
}

// `ckptio help [COMMAND]`.
int Help(const std::vector<std::string>& rest) {
  if (rest.empty()) {
    PrintTopHelp(stdout);
    return kExitOk;
  }
  const Command* c = FindCommand(rest[0]);
  if (c == nullptr) return UnknownCommand(rest[0]);
  const std::string help = "--help";
  return c->run({&help, 1});
}

int Main(std::vector<std::string> args) {
  std::vector<std::string> global;  // --config FILE given before the command
  size_t i = 0;
  for (; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") return Help({});
    if (a == "--version") {
      std::printf("ckptio %s\n%s\n", CKPTIO_VERSION, http::DescribeLibcurl().c_str());
      return kExitOk;
    }
    if (a == "--config") {
      if (i + 1 == args.size()) return Report(InvalidArgumentError("--config needs a value (FILE)"));
      global = {a, args[++i]};
    } else if (a.rfind("--config=", 0) == 0) {
      global = {a};
    } else if (!a.empty() && a[0] == '-') {
      return Report(InvalidArgumentError("unknown flag " + a + " (see: ckptio --help)"));
    } else {
      break;
    }
  }
  if (i == args.size()) {
    PrintTopHelp(stderr);
    return kExitUsage;
  }
  const std::string name = args[i];
  std::vector<std::string> rest(args.begin() + static_cast<std::ptrdiff_t>(i) + 1, args.end());
  if (name == "help") return Help(rest);
  const Command* c = FindCommand(name);
  if (c == nullptr) return UnknownCommand(name);
  rest.insert(rest.begin(), global.begin(), global.end());
  return c->run(rest);
}

}  // namespace
}  // namespace ckptio::cli

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    return ckptio::cli::Main(std::move(args));
  } catch (const std::exception& e) {
    // Exceptions are bugs (or allocation failure): say so, exit as a failure.
    std::fprintf(stderr, "ckptio: internal error: %s\n", e.what());
    return ckptio::cli::kExitFailure;
  }
}
