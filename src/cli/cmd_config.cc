// ckptio config defaults   every knob with its default, as a config file
// ckptio config show       the effective options (defaults + --config / $CKPTIO_CONFIG)

#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "cli/common.h"
#include "config/config.h"

namespace ckptio::cli {

int RunConfig(CommandArgs argv) {
  ArgParser parser("config", "defaults|show",
                   "defaults: print every knob with its default and a description, as a config file.\n"
                   "show:     print the effective config: the defaults overridden by --config FILE\n"
                   "          (else by the file $CKPTIO_CONFIG names).");
  parser.Positional("ACTION", "defaults or show");
  Args args;
  if (auto rc = ParseOrExit(parser, argv, &args)) return *rc;
  const std::string& action = args.positional(0);
  if (action == "defaults") {
    std::fputs(config::DefaultsDocument().c_str(), stdout);
    return kExitOk;
  }
  if (action != "show") {
    return Report(InvalidArgumentError("config: unknown action \"" + action +
                                       "\": expected defaults or show (see: ckptio config --help)"));
  }
  auto options = LoadOptions(args);
  if (!options.ok()) return Report(options.status());
  std::string json = config::ToJson(*options);
  if (json.empty() || json.back() != '\n') json += '\n';
  std::fputs(json.c_str(), stdout);
  return kExitOk;
}

}  // namespace ckptio::cli
