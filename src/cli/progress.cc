#include "cli/progress.h"

#include <cstdio>

namespace ckptio::cli {
namespace {

constexpr auto kRedrawInterval = std::chrono::milliseconds(100);
constexpr int kBarWidth = 30;
// Carriage return, then "erase to the end of the line".
constexpr const char* kClearLine = "\r\033[K";

}  // namespace

ProgressBar::ProgressBar(std::string label, bool enabled)
    : label_(std::move(label)), enabled_(enabled), start_(Clock::now()) {}

ProgressBar::~ProgressBar() { Finish(); }

void ProgressBar::Update(uint64_t done, uint64_t total) {
  if (!enabled_) return;
  std::lock_guard lock(mu_);
  if (finished_) return;
  const Clock::time_point now = Clock::now();
  if (drawn_ && now - last_draw_ < kRedrawInterval) return;
  last_draw_ = now;
  Draw(done, total);
}

void ProgressBar::Draw(uint64_t done, uint64_t total) {
  const double fraction = total == 0 ? 1.0 : static_cast<double>(std::min(done, total)) / static_cast<double>(total);
  const int filled = static_cast<int>(fraction * kBarWidth);
  std::string bar(static_cast<size_t>(filled), '#');
  bar.append(static_cast<size_t>(kBarWidth - filled), '.');
  const double secs = SecondsSince(start_);
  std::fprintf(stderr, "%s%s [%s] %3d%%  %s / %s  %s", kClearLine, label_.c_str(), bar.c_str(),
               static_cast<int>(fraction * 100), HumanBytes(done).c_str(), HumanBytes(total).c_str(),
               HumanRate(done, secs).c_str());
  std::fflush(stderr);
  drawn_ = true;
}

void ProgressBar::Finish() {
  if (!enabled_) return;
  std::lock_guard lock(mu_);
  finished_ = true;
  if (!drawn_) return;
  std::fputs(kClearLine, stderr);
  std::fflush(stderr);
  drawn_ = false;
}

ProgressFn ProgressBar::AsProgressFn() {
  return [this](uint64_t done, uint64_t total) { Update(done, total); };
}

}  // namespace ckptio::cli
