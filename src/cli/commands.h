#pragma once
// The `ckptio` subcommands. Each takes the words after its name and returns
// the process exit code (see common.h: 0 ok, 1 bad usage or input, 2 an I/O
// or integrity failure), having printed its errors as "ckptio: <message>".

#include <span>
#include <string>

namespace ckptio::cli {

using CommandArgs = std::span<const std::string>;

int RunDemo(CommandArgs argv);
int RunSave(CommandArgs argv);
int RunLs(CommandArgs argv);
int RunVerify(CommandArgs argv);
int RunExport(CommandArgs argv);
int RunRm(CommandArgs argv);
int RunPrune(CommandArgs argv);
int RunConfig(CommandArgs argv);

struct Command {
  const char* name;
  const char* summary;  // one line, for `ckptio --help`
  int (*run)(CommandArgs argv);
};

}  // namespace ckptio::cli
