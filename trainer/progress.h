// What a person watching the run sees (rank 0 only): a progress line with
// step, loss, tokens/s and ETA, redrawn in place on a terminal and printed
// as plain lines otherwise (logs, pipes, CI), and a final summary.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace trainer {

class ProgressBar {
 public:
  // `first_step` is the first step this run trains (> 1 when resumed);
  // `out` is written to only. is_tty decides the style; lines are printed
  // every `plain_every` steps (and on the last) when it is false.
  ProgressBar(int64_t first_step, int64_t last_step, std::FILE* out, bool is_tty,
              int64_t plain_every = 10);

  // After step `step` finished: its loss, throughput and how long the run
  // has taken since the first step began.
  void Update(int64_t step, double loss, double tokens_per_s, double elapsed_s);

  // A figure of step `step` on a line of its own ("step 50  val loss
  // 2.4817"), after the progress line (ended first on a terminal).
  void Note(int64_t step, const std::string& what, double value);

  // `line` on a line of its own (the progress line ended first on a
  // terminal), e.g. where --profile-step wrote its trace.
  void Message(const std::string& line);

  // Ends the in-place line and prints the summary: steps, first and last
  // loss, wall time, mean tokens/s, peak RSS.
  void Finish(double elapsed_s, double mean_tokens_per_s, int64_t peak_rss_bytes);

 private:
  std::string Line(int64_t step, double loss, double tokens_per_s, double elapsed_s) const;

  int64_t first_step_, last_step_;
  std::FILE* out_;
  bool is_tty_;
  int64_t plain_every_;
  bool have_loss_ = false;
  double first_loss_ = 0, last_loss_ = 0;
  int64_t last_step_done_ = 0;
};

// "1.5 GiB", "312.0 KiB": for people, not for parsing.
std::string HumanBytes(int64_t bytes);

}  // namespace trainer
