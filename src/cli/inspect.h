#pragma once
// Listing and verifying checkpoints: the bodies of `ckptio ls` and
// `ckptio verify`, shared with `ckptio demo`, which shows both at its end.
// Output goes to stdout, errors to stderr as "ckptio: ..."; the caller's
// thread only.

#include <cstdint>
#include <optional>

#include "ckptio/checkpoint_manager.h"

namespace ckptio::cli {

// One line per committed step (step, created, size, shards, tensors).
// Returns the exit code: the worst over the steps.
int ListSteps(CheckpointManager& manager);

// Verifies `step`, or every committed step if nullopt: one line per step,
// "step 200: OK, 1.0 GiB in 0.90 s", or the error on stderr. Returns the exit
// code: 2 if any step failed verification.
int VerifySteps(CheckpointManager& manager, std::optional<int64_t> step);

}  // namespace ckptio::cli
