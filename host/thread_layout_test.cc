#include "host/thread_layout.h"

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
