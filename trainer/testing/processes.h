// Test-only: run //trainer:trainer in the background and act on its ranks
// from outside (find them, stop or kill one), as the fault tests do.
#pragma once

#include <dirent.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "trainer/testing/json_lines.h"

namespace trainer::testing {

// The trainer started with `args` (a shell word list), stdout and stderr to
// `output_file`; returns its pid (the shell execs it, so it is the
// trainer's own).
inline pid_t StartTrainer(const std::string& args, const std::string& output_file) {
  const std::string command = "exec trainer/trainer " + args + " > " + output_file + " 2>&1";
  const pid_t pid = fork();
  if (pid == 0) {
    execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// Waits for `pid` and returns its exit status as a shell reports it.
inline int WaitExit(pid_t pid) {
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// The live (not zombie) children of `parent`, by /proc: the trainer's ranks.
inline std::vector<pid_t> ChildrenOf(pid_t parent) {
  std::vector<pid_t> out;
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return out;
  while (dirent* entry = readdir(proc)) {
    const pid_t pid = static_cast<pid_t>(std::atoi(entry->d_name));
    if (pid <= 0) continue;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    const auto paren = line.rfind(')');
    if (paren == std::string::npos) continue;
    std::istringstream rest(line.substr(paren + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid == parent && state != 'Z') out.push_back(pid);
  }
  closedir(proc);
  std::sort(out.begin(), out.end());
  return out;
}

inline bool Alive(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto paren = line.rfind(')');
  return paren != std::string::npos && line.size() > paren + 2 && line[paren + 2] != 'Z';
}

// The environment variable RANK of a process (-1 if unreadable).
inline int RankOf(pid_t pid) {
  std::ifstream env("/proc/" + std::to_string(pid) + "/environ", std::ios::binary);
  std::string entry;
  while (std::getline(env, entry, '\0')) {
    if (entry.rfind("RANK=", 0) == 0) return std::atoi(entry.c_str() + 5);
  }
  return -1;
}

// The steps of a --log-json file's complete lines, in order (a restart
// appends, so a step can repeat).
inline std::vector<int64_t> LoggedSteps(const std::string& path) {
  std::vector<int64_t> steps;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (in.eof()) break;  // a line still being written
    auto object = ParseJsonLine(line);
    if (object && object->count("step")) {
      steps.push_back(object->at("step").get<int64_t>());
    }
  }
  return steps;
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace trainer::testing
