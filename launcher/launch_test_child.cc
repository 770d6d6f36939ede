// A rank program for the launcher tests: behaves as its flags say.
//   --print-env           print the rank variables (stdout) and a line on stderr
//   --fail-rank R --fail-code C   rank R exits with C after 200 ms
//   --kill-self-rank R    rank R kills itself with SIGKILL after 200 ms
//   --pid-dir D           write "PID GRANDCHILD_PID" to D/rank_K
//   --spawn-grandchild    fork a child that sleeps forever
//   --ignore-sigterm      ignore SIGTERM (the launcher must SIGKILL)
//   --sleep               sleep forever after the above (else exit 0)
//   --write-closed-pipe   write to a pipe whose reader is gone; exits 3 on
//                         EPIPE (dies of SIGPIPE unless it is ignored)
//   --fail-until-restart K  with --fail-rank/--kill-self-rank: only fail
//                         while TORCHELASTIC_RESTART_COUNT < K (then exit 0)
//   --hang-rank R         rank R stops itself (SIGSTOP) after 200 ms; the
//                         others exit 1 after 1.5 s saying their collective
//                         timed out (a peer that hung)
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

int main(int argc, char** argv) {
  const char* rank_text = std::getenv("RANK");
  const int rank = rank_text ? std::atoi(rank_text) : -1;
  bool print_env = false, spawn = false, ignore_term = false, sleep = false;
  bool write_closed_pipe = false;
  int fail_rank = -1, fail_code = 0, kill_rank = -1, fail_until_restart = -1, hang_rank = -1;
  const char* restart_text = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const int restart = restart_text ? std::atoi(restart_text) : -1;
  std::string pid_dir;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--print-env")
      print_env = true;
    else if (a == "--fail-rank")
      fail_rank = std::atoi(next().c_str());
    else if (a == "--fail-code")
      fail_code = std::atoi(next().c_str());
    else if (a == "--kill-self-rank")
      kill_rank = std::atoi(next().c_str());
    else if (a == "--pid-dir")
      pid_dir = next();
    else if (a == "--spawn-grandchild")
      spawn = true;
    else if (a == "--ignore-sigterm")
      ignore_term = true;
    else if (a == "--sleep")
      sleep = true;
    else if (a == "--write-closed-pipe")
      write_closed_pipe = true;
    else if (a == "--fail-until-restart")
      fail_until_restart = std::atoi(next().c_str());
    else if (a == "--hang-rank")
      hang_rank = std::atoi(next().c_str());
    else {
      std::fprintf(stderr, "unknown flag %s\n", a.c_str());
      return 64;
    }
  }
  if (ignore_term) signal(SIGTERM, SIG_IGN);
  if (write_closed_pipe) {
    int fds[2];
    if (pipe(fds) != 0) return 64;
    close(fds[0]);
    if (write(fds[1], "x", 1) < 0 && errno == EPIPE) {
      std::fprintf(stderr, "write: EPIPE\n");
      return 3;
    }
    return 4;
  }
  if (print_env) {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                             "MASTER_PORT", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT",
                             "TORCHELASTIC_MAX_RESTARTS", "COMM_COLLECTIVE_TIMEOUT_MS"}) {
      const char* v = std::getenv(name);
      std::printf("%s=%s\n", name, v ? v : "<unset>");
    }
    std::fprintf(stderr, "hello from stderr\n");
    std::fflush(stdout);
  }
  pid_t grandchild = 0;
  if (spawn) {
    grandchild = fork();
    if (grandchild == 0) {
      for (;;) pause();
    }
  }
  if (!pid_dir.empty()) {
    const std::string path = pid_dir + "/rank_" + std::to_string(rank);
    const std::string tmp = path + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "w");
    if (f) {
      std::fprintf(f, "%d %d\n", static_cast<int>(getpid()), static_cast<int>(grandchild));
      std::fclose(f);
      std::rename(tmp.c_str(), path.c_str());
    }
  }
  if (hang_rank >= 0) {
    if (rank == hang_rank) {
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      raise(SIGSTOP);
      for (;;) pause();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    std::fprintf(stderr, "rank %d: all_reduce timed out after 1500 ms\n", rank);
    return 1;
  }
  if (fail_until_restart >= 0 && restart >= fail_until_restart) {
    std::printf("rank %d: restart %d, not failing\n", rank, restart);
    return 0;
  }
  if (rank == fail_rank || rank == kill_rank) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (rank == kill_rank) raise(SIGKILL);
    std::printf("rank %d failing with %d\n", rank, fail_code);
    std::fprintf(stderr, "rank %d: simulated checksum mismatch\n", rank);
    return fail_code;
  }
  if (sleep || fail_rank >= 0 || kill_rank >= 0) {
    for (;;) pause();
  }
  return 0;
}
