#pragma once
// What every `ckptio` subcommand shares: exit codes, error printing, the
// effective Options, opening a manager for reading, and human-readable units.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "ckptio/checkpoint_manager.h"
#include "ckptio/options.h"
#include "ckptio/status.h"
#include "cli/args.h"

namespace ckptio::cli {

using Clock = std::chrono::steady_clock;

inline constexpr int kExitOk = 0;
inline constexpr int kExitUsage = 1;    // bad usage or bad input: fix the command line or the input
inline constexpr int kExitFailure = 2;  // the storage or the data failed: I/O error, corruption, ...

// The one mapping from a status to the process exit code.
int ExitCodeFor(StatusCode code);

// Prints "ckptio: <message>" on stderr for an error; returns the exit code
// (kExitOk for an ok status, which prints nothing).
int Report(const Status& status);

// Parses `argv` (the words after the subcommand). Returns the exit code to
// end with when the command should not run: 0 after printing the help for
// --help, 1 after printing a usage error. nullopt: *args is ready.
std::optional<int> ParseOrExit(const ArgParser& parser, std::span<const std::string> argv, Args* args);

// Defaults, overridden by the config file named by --config (else by
// $CKPTIO_CONFIG).
Result<Options> LoadOptions(const Args& args);

// For commands that only read or delete checkpoints: no big staging memory
// (1 MiB, the minimum) and no registered buffers. (Whether the manager is a
// reader or a writer is OpenExistingRoot's read_only.)
Options ReadOnlyOptions(Options options);

// Opens the checkpoint root `root`, which must exist already (only a save
// creates one): read-only (no lock) or as the writer.
Result<std::unique_ptr<CheckpointManager>> OpenExistingRoot(const std::string& root, Options options, bool read_only);

// The manager of the root named by the first positional, which must exist,
// with the --config options made read-only (ReadOnlyOptions): for the
// commands that read, or only delete, checkpoints.
Result<std::unique_ptr<CheckpointManager>> OpenRootForReading(const Args& args);

// The step a --step flag names, or nullopt if absent.
Result<std::optional<int64_t>> StepFlag(const Args& args);

// "512 B", "64.0 MiB", "1.0 GiB".
std::string HumanBytes(uint64_t bytes);
// "1.4 GiB/s"; "-" if seconds is 0.
std::string HumanRate(uint64_t bytes, double seconds);
// "0.93 s", "12.4 s".
std::string HumanSeconds(double seconds);

double SecondsSince(Clock::time_point start);

// True if stderr is a terminal (progress bars go there).
bool StderrIsTerminal();

}  // namespace ckptio::cli
