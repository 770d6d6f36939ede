#include "trainer/progress.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_format.h"

namespace trainer {
namespace {

constexpr int kBarWidth = 24;

std::string Duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
  if (s >= 60) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%ds", s);
}

}  // namespace

std::string HumanBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  return absl::StrFormat("%.1f %s", v, units[u]);
}

ProgressBar::ProgressBar(int64_t first_step, int64_t last_step, std::FILE* out, bool is_tty,
                         int64_t plain_every)
    : first_step_(first_step),
      last_step_(last_step),
      out_(out),
      is_tty_(is_tty),
      plain_every_(std::max<int64_t>(1, plain_every)) {}

std::string ProgressBar::Line(int64_t step, double loss, double tokens_per_s,
                              double elapsed_s) const {
  const int64_t done = step - first_step_ + 1;
  const int64_t total = last_step_ - first_step_ + 1;
  const double eta = elapsed_s / done * static_cast<double>(total - done);
  std::string line = absl::StrFormat(
      "step %*d/%d", 1 + static_cast<int>(std::log10(std::max<int64_t>(1, last_step_))), step,
      last_step_);
  if (is_tty_) {
    const int filled = static_cast<int>(kBarWidth * done / std::max<int64_t>(1, total));
    line = absl::StrFormat("[%s%s] %s", std::string(filled, '#'),
                           std::string(kBarWidth - filled, '.'), line);
  }
  return absl::StrFormat("%s  loss %.4f  %.0f tok/s  ETA %s", line, loss, tokens_per_s,
                         Duration(eta));
}

void ProgressBar::Update(int64_t step, double loss, double tokens_per_s, double elapsed_s) {
  if (!have_loss_) first_loss_ = loss;
  have_loss_ = true;
  last_loss_ = loss;
  last_step_done_ = step;
  const std::string line = Line(step, loss, tokens_per_s, elapsed_s);
  if (is_tty_) {
    // \r and clear-to-end-of-line: redraw the one line in place.
    std::fprintf(out_, "\r%s\x1b[K", line.c_str());
  } else if ((step - first_step_ + 1) % plain_every_ == 0 || step == first_step_ ||
             step == last_step_) {
    std::fprintf(out_, "%s\n", line.c_str());
  }
  std::fflush(out_);
}

void ProgressBar::Note(int64_t step, const std::string& what, double value) {
  if (is_tty_) std::fputc('\n', out_);
  std::fprintf(out_, "step %lld  %s %.4f\n", static_cast<long long>(step), what.c_str(), value);
  std::fflush(out_);
}

void ProgressBar::Message(const std::string& line) {
  if (is_tty_) std::fputc('\n', out_);
  std::fprintf(out_, "%s\n", line.c_str());
  std::fflush(out_);
}

void ProgressBar::Finish(double elapsed_s, double mean_tokens_per_s, int64_t peak_rss_bytes) {
  if (is_tty_ && have_loss_) std::fputc('\n', out_);
  if (have_loss_) {
    std::fprintf(out_,
                 "done: steps %lld-%lld in %s (%.2f s/step), loss %.4f -> %.4f, "
                 "%.0f tok/s, peak RSS %s (rank 0)\n",
                 static_cast<long long>(first_step_), static_cast<long long>(last_step_done_),
                 Duration(elapsed_s).c_str(),
                 elapsed_s / static_cast<double>(last_step_done_ - first_step_ + 1), first_loss_,
                 last_loss_, mean_tokens_per_s, HumanBytes(peak_rss_bytes).c_str());
  } else {
    std::fprintf(out_, "done: no step to train (already at step %lld)\n",
                 static_cast<long long>(last_step_));
  }
  std::fflush(out_);
}

}  // namespace trainer
