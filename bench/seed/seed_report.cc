#include "seed/seed_report.h"

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <numeric>

#include "cli/common.h"

namespace ckptio::cli {
namespace {

std::string Fmt(const char* format, ...) __attribute__((format(printf, 1, 2)));
std::string Fmt(const char* format, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, format);
  std::vsnprintf(buf, sizeof buf, format, ap);
  va_end(ap);
  return buf;
}

std::string Seconds(double s) { return Fmt("%.2f s", s); }
std::string Percent(double fraction) { return Fmt("%.1f%%", 100 * fraction); }

const ModeResult* Find(const std::vector<ModeResult>& results, SeedMode mode) {
  for (const ModeResult& r : results) {
    if (r.mode == mode) return &r;
  }
  return nullptr;
}

// "3/3 ok" or "0/3 ok: 3 torn, 2 leaked".
std::string KeptCell(const AuditResult& a) {
  if (!a.error.empty()) return "audit failed";
  std::string out = Fmt("%d/%d ok", a.good, a.expected);
  std::vector<std::string> bad;
  if (a.torn > 0) bad.push_back(Fmt("%d torn", a.torn));
  if (a.incomplete > 0) bad.push_back(Fmt("%d incomplete", a.incomplete));
  if (a.missing > 0) bad.push_back(Fmt("%d missing", a.missing));
  if (a.leaked > 0) bad.push_back(Fmt("%d not pruned", a.leaked));
  for (size_t i = 0; i < bad.size(); ++i) out += (i == 0 ? ": " : ", ") + bad[i];
  return out;
}

std::string StepList(const AuditResult& a, bool (*pick)(const StepAudit&)) {
  std::string out;
  for (const StepAudit& s : a.steps) {
    if (pick(s)) out += (out.empty() ? "" : ", ") + std::to_string(s.step);
  }
  return out.empty() ? "none" : out;
}

int TornTensors(const AuditResult& a) {
  int n = 0;
  for (const StepAudit& s : a.steps) n += s.expected ? s.tensors_torn : 0;
  return n;
}

// One line on what the audit found for a mode.
std::string AuditLine(const ModeResult& r, bool audit_on) {
  const AuditResult& a = r.audit;
  if (!a.error.empty()) return "the audit failed: " + a.error;
  std::string out = Fmt("of the %d checkpoints keep=%d should leave (steps %s), %d %s complete%s", a.expected,
                        a.expected, StepList(a, [](const StepAudit& s) { return s.expected; }).c_str(), a.good,
                        a.good == 1 ? "is" : "are", audit_on ? " and bit-exact vs the state at save time" : "");
  if (a.torn > 0) {
    out += Fmt("; %d torn: %d of their %d tensors differ from the state at save time", a.torn, TornTensors(a),
               a.torn * a.tensors);
  }
  if (a.incomplete > 0) {
    out += Fmt("; %d incomplete (steps %s)", a.incomplete,
               StepList(a, [](const StepAudit& s) { return s.expected && s.present && !s.complete; }).c_str());
  }
  if (a.missing > 0) {
    out += Fmt("; %d missing (steps %s)", a.missing,
               StepList(a, [](const StepAudit& s) { return s.expected && !s.present; }).c_str());
  }
  if (a.leaked > 0) {
    out += Fmt("; %d older ones not pruned (steps %s)", a.leaked,
               StepList(a, [](const StepAudit& s) { return !s.expected && s.present; }).c_str());
  }
  return out + ".";
}

std::string NaiveErrorsLine(const NaiveErrors& e) {
  std::string out = Fmt(
      "Up to %d threads wrote at once; %d write errors; prune errors: %d deletes of a checkpoint another thread "
      "had already (partly) deleted, %d checkpoints deleted while their own thread was still writing them, %d other",
      e.max_concurrent, e.write_errors, e.prune_already_gone, e.prune_in_flight, e.prune_other);
  if (!e.first_error.empty()) out += " (first: " + e.first_error + ")";
  return out + ".";
}

// The floor of a copy snapshot: one memcpy of the state at the measured
// speed, in seconds (0: not measured).
double CopyFloor(const SeedEnvironment& env) {
  return env.copy_bytes_per_s > 0 ? static_cast<double>(env.state_bytes) / env.copy_bytes_per_s : 0;
}

double ComputeEach(const SeedConfig& config) { return std::chrono::duration<double>(config.compute).count(); }

// Mean time of the Save() calls alone (blocked also holds ckptio-borrow's
// waits for a borrowed set).
double MeanSaveCall(const ModeResult& r) {
  const double n = std::max<double>(1, static_cast<double>(r.save_seconds.size()));
  return (r.blocked - r.borrow_wait) / n;
}

// What the machine allows a copy snapshot: one copy of the state at the
// measured memcpy speed, against the compute between saves; and what
// borrowing makes of it.
std::string CopyLimitLine(const SeedConfig& config, const ModeResult& r, const SeedEnvironment& env) {
  const double floor = CopyFloor(env);
  if (floor <= 0 || r.save_seconds.empty()) return "";
  const double compute_each = std::max(ComputeEach(config), 1e-9);
  const double mean = MeanSaveCall(r);
  if (r.mode == SeedMode::kCkptioBorrow) {
    return Fmt("- ckptio-borrow skips that copy: its Save() averaged %.2f ms, %.3fx the copy floor of %.0f ms.\n",
               1e3 * mean, mean / floor, 1e3 * floor);
  }
  return Fmt("- the limit: a warm memcpy on %u threads ran at %.1f GB/s here, so one copy of the %s state takes at "
             "least %.0f ms, %.1f%% of the %.2f s of compute between saves; ckptio's Save() averaged %.0f ms, %.2fx "
             "that floor. A snapshot by copy cannot cost the trainer less than this share.\n",
             env.copy_threads, env.copy_bytes_per_s / 1e9, HumanBytes(env.state_bytes).c_str(), 1e3 * floor,
             100 * floor / compute_each, compute_each, 1e3 * mean, mean / floor);
}

// Where a ckptio mode's overhead goes: the Save() calls, (borrow) the waits
// for a borrowed set, the final wait, the rest.
std::string CkptioOverheadLines(const SeedConfig& config, const ModeResult& r, const SeedEnvironment& env) {
  const double mean = MeanSaveCall(r);
  const double max = r.save_seconds.empty() ? 0 : *std::max_element(r.save_seconds.begin(), r.save_seconds.end());
  const double compute_each = std::max(ComputeEach(config), 1e-9);
  const double compute = std::max(r.compute, 1e-9);
  const double other = r.total - r.compute - r.blocked - r.final_wait;
  const char* name = SeedModeName(r.mode);
  std::string out;
  if (r.mode == SeedMode::kCkptioBorrow) {
    out += Fmt("- ckptio-borrow: Save() blocked the trainer %.2f ms per save on average (max %.2f ms): %.3f%% of the "
               "%.2f s of compute between saves. No copy: it plans the shards and hands the borrowed set to the "
               "background. Before a compute the trainer found the save that borrowed the set it overwrites still "
               "running %d time(s), and waited %.2f s for it in all (counted as blocked in saves).\n",
               1e3 * mean, 1e3 * max, 100 * mean / compute_each, compute_each, r.borrow_waits, r.borrow_wait);
  } else {
    out += Fmt("- ckptio: Save() blocked the trainer %.0f ms per save on average (max %.0f ms): %.1f%% of the %.2f s "
               "of compute between saves. That is the snapshot, a copy of the whole state into staging memory.\n",
               1e3 * mean, 1e3 * max, 100 * mean / compute_each, compute_each);
  }
  const std::string waits =
      r.mode == SeedMode::kCkptioBorrow
          ? Fmt(" + %.2f s waiting for borrowed sets (%s)", r.borrow_wait, Percent(r.borrow_wait / compute).c_str())
          : "";
  out += Fmt("- %s overhead %.2f s = %.2f s in Save() (%s of compute)%s + %.2f s final WaitUntilFinished (%s: "
             "the last save's write) + %.2f s other (the loop between calls).\n",
             name, r.total - r.compute, r.blocked - r.borrow_wait,
             Percent((r.blocked - r.borrow_wait) / compute).c_str(), waits.c_str(), r.final_wait,
             Percent(r.final_wait / compute).c_str(), other);
  out += CopyLimitLine(config, r, env);
  return out;
}

// Why a ckptio mode meets or misses the 2% target: its parts, and what
// bounds the largest.
std::string TargetReason(const SeedConfig& config, const ModeResult& r, const SeedEnvironment& env) {
  const double compute = std::max(r.compute, 1e-9);
  const double calls = (r.blocked - r.borrow_wait) / compute;
  const double floor_share = CopyFloor(env) / std::max(ComputeEach(config), 1e-9);
  std::string out = Fmt("%s in Save()", Percent(calls).c_str());
  if (r.mode == SeedMode::kCkptio) {
    out += floor_share > 0.02
               ? Fmt(" (the copy; its memcpy floor alone is %s of compute here, so a copy snapshot cannot meet 2%%)",
                     Percent(floor_share).c_str())
               : " (the copy)";
  } else {
    out += Fmt(" (no copy) + %s waiting for borrowed sets", Percent(r.borrow_wait / compute).c_str());
  }
  out += Fmt(" + %s the final wait for the last save", Percent(r.final_wait / compute).c_str());
  if (Overhead(r) > 0.02 && r.final_wait > r.blocked) {
    out += " (the largest part: write or upload, commit and prune of one save after the last compute, a one-off "
           "whose share shrinks as a run saves more often)";
  }
  return out;
}

// One line: which ckptio mode meets the target, which misses it, and why.
std::string TargetLine(const SeedConfig& config, const std::vector<ModeResult>& results, const SeedEnvironment& env) {
  std::string met;
  std::string missed;
  std::string why;
  for (const ModeResult& r : results) {
    if (!IsCkptioMode(r.mode)) continue;
    std::string& list = Overhead(r) <= 0.02 ? met : missed;
    list += Fmt("%s%s (%s)", list.empty() ? "" : ", ", SeedModeName(r.mode), Percent(Overhead(r)).c_str());
    why += std::string(" ") + SeedModeName(r.mode) + ": " + TargetReason(config, r, env) + ".";
  }
  if (why.empty()) return "";
  // Concatenated, not Fmt: the line outgrows Fmt's buffer.
  return "- target (ckptio overhead <= 2%): met by " + (met.empty() ? "none" : met) + "; missed by " +
         (missed.empty() ? "none" : missed) + "." + why + "\n";
}

// The trainer's state plus the manager's staging, per manager mode.
std::string MemoryLine(const std::vector<ModeResult>& results) {
  std::string parts;
  bool borrow = false;
  for (const ModeResult& r : results) {
    if (r.mode == SeedMode::kNaive || r.state_memory == 0) continue;
    borrow = borrow || r.mode == SeedMode::kCkptioBorrow;
    parts += Fmt("%s%s %s (state %s + staging_memory %s)", parts.empty() ? "" : "; ", SeedModeName(r.mode),
                 HumanBytes(r.state_memory + r.staging_memory).c_str(), HumanBytes(r.state_memory).c_str(),
                 HumanBytes(r.staging_memory).c_str());
  }
  if (parts.empty()) return "";
  std::string out = "- memory held, trainer state + staging: " + parts + ".";
  if (borrow) {
    out += " ckptio-borrow's trainer keeps two sets of its state (like a JAX step, which returns new arrays while "
           "the old ones still exist; here the old set lives until the save that borrowed it ends), and its staging "
           "holds only the shard headers.";
  }
  return out + "\n";
}

std::string SettingLines(const SeedConfig& config, const SeedEnvironment& env) {
  std::string out;
  out += Fmt("- %s; state %s in %zu tensors (%s); %d saves, %.2f s of compute before each; keep %d; into %s.\n",
             env.date.c_str(), HumanBytes(env.state_bytes).c_str(), env.tensors, env.dtypes.c_str(), config.saves,
             std::chrono::duration<double>(config.compute).count(), config.keep, config.dest.c_str());
  const bool borrow =
      std::find(config.modes.begin(), config.modes.end(), SeedMode::kCkptioBorrow) != config.modes.end();
  const std::string borrow_staging =
      borrow ? " (ckptio-borrow: " + HumanBytes(config.borrow_staging_memory) + ", for the shard headers alone)" : "";
  out += Fmt("- ckptio options: staging_memory %s%s, shard_size %s, max_in_flight %d, snapshot_crc %s, threads %d%s.\n",
             HumanBytes(config.options.staging_memory).c_str(), borrow_staging.c_str(),
             HumanBytes(config.options.shard_size).c_str(),
             config.options.max_in_flight,
             config.options.snapshot_crc == SnapshotCrc::kFused ? "fused" : "background", config.options.threads,
             config.gcs() ? Fmt(", gcs.chunk_size %s, gcs.connections %d",
                                HumanBytes(config.options.gcs.chunk_size).c_str(), config.options.gcs.connections)
                                .c_str()
                          : "");
  out += Fmt("- machine: %d cores; 1-minute load average %s before the run, %s after (other work on the machine "
             "competes for the cores).\n",
             env.cores, env.load_before.c_str(), env.load_after.c_str());
  if (!config.note.empty()) out += "- " + config.note + "\n";
  if (!env.command.empty()) out += "- command: `" + env.command + "`\n";
  return out;
}

std::string DefinitionLines(const SeedConfig& config) {
  std::string out;
  out += "- total: wall time from the first compute to the end of the last save (the final wait included)";
  out += config.audit ? ", minus the untimed audit pauses (below).\n" : ".\n";
  out += "- compute: time in the trainer's compute. blocked in saves: what the save calls held the trainer (blocking: "
         "Save + Wait; naive: starting the thread; ckptio: Save; ckptio-borrow: Save, and waiting before a compute for the save that "
         "still borrows the set it overwrites). final wait: WaitUntilFinished, or joining the "
         "naive threads. overhead: (total - compute) / compute, as the original report's 42%. speedup: blocking "
         "total / total. checkpoint bytes/s: bytes saved / time during which a save was in flight.\n";
  out += "- trainer CPU in compute: the trainer thread's CPU time / its compute wall time. The compute is "
         "time-boxed, so work competing for the cores (background writes, CRC32C, an emulator, other processes) "
         "does not lengthen the run; it shows here as training lost in the same time.\n";
  if (config.audit) {
    out += "- audit: before each save the trainer's thread takes the CRC32C of every tensor (the state as of that "
           "save); that pause is left out of every total. At the end each checkpoint is read back (a read-only "
           "manager, or the naive files / the objects' CRC32C) and compared tensor by tensor.\n";
  }
  return out;
}

}  // namespace

double Overhead(const ModeResult& r) { return r.compute > 0 ? (r.total - r.compute) / r.compute : 0; }

std::string HumanPanelSummary(const ModeResult& r) {
  return Fmt("total %.1f s, trainer blocked %.2f s in saves + %.2f s final wait, overhead %.1f%%", r.total, r.blocked,
             r.final_wait, 100 * Overhead(r));
}

std::string SeedTable(const std::vector<ModeResult>& results) {
  const ModeResult* blocking = Find(results, SeedMode::kBlocking);
  std::string out =
      "| mode | total | compute | blocked in saves | final wait | overhead | speedup | checkpoint bytes/s | "
      "trainer CPU in compute | checkpoints kept |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n";
  for (const ModeResult& r : results) {
    std::string speedup = blocking != nullptr && r.total > 0 ? Fmt("%.2fx", blocking->total / r.total) : "-";
    out += Fmt("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", SeedModeName(r.mode), Seconds(r.total).c_str(),
               Seconds(r.compute).c_str(), Seconds(r.blocked).c_str(), Seconds(r.final_wait).c_str(),
               Percent(Overhead(r)).c_str(), speedup.c_str(), HumanRate(r.bytes, r.persisting).c_str(),
               Percent(r.compute > 0 ? r.compute_cpu / r.compute : 0).c_str(), KeptCell(r.audit).c_str());
  }
  return out;
}

std::string SeedNotes(const SeedConfig& config, const std::vector<ModeResult>& results, const SeedEnvironment& env) {
  std::string out = SettingLines(config, env) + DefinitionLines(config);
  for (const ModeResult& r : results) {
    out += std::string("- ") + SeedModeName(r.mode) + ": " + AuditLine(r, config.audit);
    if (r.mode == SeedMode::kNaive) {
      out += " " + NaiveErrorsLine(r.naive);
    } else {
      out += Fmt(" Saves between their Save() call and their commit at once: up to %d.", r.max_in_flight);
    }
    if (r.mode == SeedMode::kCkptioBorrow) {
      out += " Its trainer is double-buffered (a compute writes the whole next state into the other set); the audit "
             "compares each checkpoint with the borrowed set as of its save.";
    }
    if (!r.error.empty()) out += " The run failed: " + r.error;
    out += "\n";
  }
  if (const ModeResult* naive = Find(results, SeedMode::kNaive); naive != nullptr && !config.gcs()) {
    out += "- naive (local) writes through the page cache without fsync: its checkpoints were not durable when its "
           "run ended, which flatters its times.\n";
  }
  out += MemoryLine(results);
  for (const ModeResult& r : results) {
    if (IsCkptioMode(r.mode)) out += CkptioOverheadLines(config, r, env);
  }
  out += TargetLine(config, results, env);
  return out;
}

std::string NaiveStepTable(const ModeResult& naive) {
  std::string out =
      "| step | thread: write | thread: prune | write errors | checkpoints it pruned | at the end |\n"
      "|---:|---:|---:|---:|---:|---|\n";
  for (const NaiveThreadSummary& t : naive.threads) {
    std::string end = "?";
    for (const StepAudit& a : naive.audit.steps) {
      if (a.step != t.step) continue;
      if (!a.present) {
        end = a.expected ? "**missing**" : "pruned";
      } else if (!a.complete) {
        end = Fmt("**incomplete** (%d of %d tensors)", a.tensors_present, naive.audit.tensors);
      } else if (a.tensors_torn > 0) {
        end = Fmt("**torn** (%d of %d tensors differ)", a.tensors_torn, naive.audit.tensors);
      } else {
        end = a.checked ? "complete, bit-exact" : "complete";
      }
      if (a.present && !a.expected) end += ", should have been pruned";
    }
    out += Fmt("| %lld | %s | %s | %d | %d | %s |\n", static_cast<long long>(t.step), Seconds(t.write_seconds).c_str(),
               Seconds(t.prune_seconds).c_str(), t.write_errors, t.pruned, end.c_str());
  }
  return out;
}

}  // namespace ckptio::cli
