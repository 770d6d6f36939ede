#include "comm/slurm.h"

#include <cstdlib>
#include <map>
#include <string>

#include <gtest/gtest.h>

namespace comm {
namespace {

TEST(FirstSlurmHost, TakesTheFirstHostOfEachForm) {
  const std::map<std::string, std::string> cases = {
      {"gnode[10,20,25,37]", "gnode10"},   {"node[07-09,12],gpu1", "node07"},
      {"rack[1-2]-n[01-04]", "rack1-n01"}, {"login1,login2", "login1"},
      {"127.0.0.1", "127.0.0.1"},          {"n[003]", "n003"}};
  for (const auto& [list, want] : cases) {
    auto host = first_slurm_host(list);
    ASSERT_TRUE(host.ok()) << list << ": " << host.status();
    EXPECT_EQ(*host, want) << list;
  }
  for (const char* bad : {"", "node[01-04", "node]1[", "n[]", ",x"}) {
    auto host = first_slurm_host(bad);
    EXPECT_TRUE(absl::IsInvalidArgument(host.status())) << bad;
    EXPECT_NE(host.status().message().find("Slurm hostlist '"), std::string::npos) << host.status();
  }
}

class SlurmEnvTest : public ::testing::Test {
 protected:
  void SetUp() override { Clear(); }
  void TearDown() override { Clear(); }
  static void Clear() {
    for (const char* name :
         {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_ID",
          "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_LOCALID",
          "SLURM_STEP_NUM_NODES", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}) {
      unsetenv(name);
    }
  }
  // Task 5 of a 2-node, 8-task step, as srun sets it.
  static void SrunTask() {
    setenv("SLURM_STEP_ID", "0", 1);
    setenv("SLURM_PROCID", "5", 1);
    setenv("SLURM_STEP_NUM_TASKS", "8", 1);
    setenv("SLURM_LOCALID", "1", 1);
    setenv("SLURM_STEP_NUM_NODES", "2", 1);
    setenv("SLURM_STEP_NODELIST", "gpu[07-08]", 1);
  }
};

TEST_F(SlurmEnvTest, SrunTaskMapsToTheLauncherVariables) {
  SrunTask();
  ASSERT_TRUE(is_slurm_task());
  auto env = slurm_rank_environment();
  ASSERT_TRUE(env.ok()) << env.status();
  ASSERT_TRUE(env->has_value());
  EXPECT_EQ((*env)->rank, 5);
  EXPECT_EQ((*env)->world_size, 8);
  EXPECT_EQ((*env)->local_rank, 1);
  EXPECT_EQ((*env)->local_world_size, 4);
  EXPECT_EQ((*env)->master_addr, "gpu07");
  EXPECT_EQ((*env)->master_port, kSlurmDefaultMasterPort);
  auto read = read_rank_environment();  // what every env:// rank reads
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->rank, 5);
  EXPECT_EQ(read->master_addr, "gpu07");

  setenv("MASTER_ADDR", "10.0.0.9", 1);
  setenv("MASTER_PORT", "31000", 1);
  env = slurm_rank_environment();
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ((*env)->master_addr, "10.0.0.9");
  EXPECT_EQ((*env)->master_port, 31000);
}

TEST_F(SlurmEnvTest, BatchScriptsAndLaunchersAreNotSrunTasks) {
  // The batch script has SLURM_PROCID=0 and SLURM_NTASKS but no step.
  setenv("SLURM_PROCID", "0", 1);
  setenv("SLURM_NTASKS", "4", 1);
  EXPECT_FALSE(is_slurm_task());
  auto env = slurm_rank_environment();
  ASSERT_TRUE(env.ok());
  EXPECT_FALSE(env->has_value());
  // A launcher (torchrun under srun) sets RANK: its variables win.
  SrunTask();
  setenv("RANK", "0", 1);
  EXPECT_FALSE(is_slurm_task());
}

TEST_F(SlurmEnvTest, BadSlurmVariablesNameTheVariable) {
  SrunTask();
  setenv("SLURM_PROCID", "8", 1);
  auto env = slurm_rank_environment();
  EXPECT_EQ(env.status().message(),
            "environment variable SLURM_PROCID='8': expected a task id in [0, 8)");
  SrunTask();
  unsetenv("SLURM_STEP_NUM_TASKS");
  setenv("SLURM_NTASKS", "x", 1);
  env = slurm_rank_environment();
  EXPECT_EQ(env.status().message(),
            "environment variable SLURM_NTASKS='x': expected a positive task count");
  SrunTask();
  setenv("SLURM_STEP_NODELIST", "gpu[07", 1);
  env = slurm_rank_environment();
  EXPECT_NE(env.status().message().find("SLURM_STEP_NODELIST: Slurm hostlist 'gpu[07'"),
            std::string::npos)
      << env.status();
  SrunTask();
  setenv("MASTER_PORT", "70000", 1);
  env = slurm_rank_environment();
  EXPECT_EQ(env.status().message(),
            "environment variable MASTER_PORT='70000': expected a TCP port in [1, 65535]");
}

}  // namespace
}  // namespace comm
