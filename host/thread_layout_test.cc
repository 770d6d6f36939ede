#include "host/thread_layout.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace host {
namespace {

using ::testing::HasSubstr;

TEST(ThreadLayoutTest, AutomaticSharesTheCoresAmongLocalRanks) {
  const int cores = AvailableCores();
  auto one = PlanThreadLayout(1, 0, nullptr);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->threads_per_rank, cores);
  EXPECT_EQ(one->source, ThreadLayout::Source::kAutomatic);
  EXPECT_TRUE(one->warning.empty());

  auto many = PlanThreadLayout(cores + 1, 0, nullptr);
  ASSERT_TRUE(many.ok());
  EXPECT_EQ(many->threads_per_rank, 1);  // at least one, never zero
  EXPECT_TRUE(many->warning.empty());    // more ranks than cores: caller's choice
}

TEST(ThreadLayoutTest, EachRankIsBoundToItsOwnCpusOnlyWhenTheyFit) {
  ThreadLayout layout;
  layout.cpus = {0, 2, 4, 6, 8};  // a cpuset's ids need not be contiguous
  layout.cores = 5;
  layout.local_ranks = 2;
  layout.threads_per_rank = 2;
  EXPECT_EQ(CpusOfRank(layout, 0), (std::vector<int>{0, 2}));
  EXPECT_EQ(CpusOfRank(layout, 1), (std::vector<int>{4, 6}));
  EXPECT_TRUE(CpusOfRank(layout, 2).empty());  // no such local rank
  EXPECT_TRUE(CpusOfRank(layout, -1).empty());
  layout.threads_per_rank = 3;  // 2 x 3 > 5 CPUs: none bound
  EXPECT_TRUE(CpusOfRank(layout, 0).empty());
  layout.local_ranks = 6;
  layout.threads_per_rank = 1;  // more ranks than CPUs
  EXPECT_TRUE(CpusOfRank(layout, 0).empty());

  auto planned = PlanThreadLayout(1, 0, nullptr);  // this process's own CPUs
  ASSERT_TRUE(planned.ok());
  EXPECT_EQ(static_cast<int>(planned->cpus.size()), planned->cores);
  EXPECT_EQ(CpusOfRank(*planned, 0), planned->cpus);
}

TEST(ThreadLayoutTest, RequestBeatsEnvironmentBeatsAutomatic) {
  auto env = PlanThreadLayout(1, 0, "1");
  ASSERT_TRUE(env.ok());
  EXPECT_EQ(env->threads_per_rank, 1);
  EXPECT_EQ(env->source, ThreadLayout::Source::kEnvironment);

  auto requested = PlanThreadLayout(1, 1, "3");
  ASSERT_TRUE(requested.ok());
  EXPECT_EQ(requested->threads_per_rank, 1);
  EXPECT_EQ(requested->source, ThreadLayout::Source::kRequested);
}

TEST(ThreadLayoutTest, OversubscriptionIsAWarningNamingBothNumbers) {
  const int cores = AvailableCores();
  auto layout = PlanThreadLayout(2, cores, nullptr);
  ASSERT_TRUE(layout.ok());
  EXPECT_THAT(layout->warning, HasSubstr("oversubscribed"));
  EXPECT_THAT(layout->warning, HasSubstr(std::to_string(2 * cores) + " threads on " +
                                         std::to_string(cores) + " cores"));
  EXPECT_THAT(layout->ToString(), HasSubstr("2 ranks x"));
}

TEST(ThreadLayoutTest, BadValuesNameTheirSource) {
  auto env = PlanThreadLayout(1, 0, "many");
  EXPECT_FALSE(env.ok());
  EXPECT_THAT(std::string(env.status().message()), HasSubstr("OMP_NUM_THREADS='many'"));
  EXPECT_FALSE(PlanThreadLayout(1, 0, "0").ok());
  auto flag = PlanThreadLayout(1, -2, nullptr);
  EXPECT_THAT(std::string(flag.status().message()), HasSubstr("--threads-per-rank=-2"));
  EXPECT_FALSE(PlanThreadLayout(0, 0, nullptr).ok());
}

}  // namespace
}  // namespace host
