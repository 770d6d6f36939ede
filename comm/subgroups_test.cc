// Sub-groups, intra/inter-node groups and the 2-D mesh on 4 real ranks:
// membership for every rank, hybrid all-reduce equal to the flat one, and
// the shape errors of PyTorch (FSDP's _init_utils).
#include "comm/subgroups.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>

#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/collectives.h"
#include "comm/device_mesh.h"
#include "testing/multiprocess.h"

namespace comm {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string message(const absl::Status& status) { return std::string(status.message()); }

TEST(Subgroups, MembershipMeshAndHybridAllReduceOnFourRanks) {
  testing::RunOnRanks(4, [](ProcessGroup& world) {
    const int rank = world.rank();

    // new_group: ranks of the parent, in the listed order.
    auto odd = new_group(world, {3, 1});
    ASSERT_TRUE(odd.ok()) << odd.status();
    EXPECT_EQ(odd->is_member(), rank % 2 == 1);
    EXPECT_EQ(odd->size(), 2);
    EXPECT_THAT(odd->global_ranks(), ElementsAre(3, 1));
    EXPECT_EQ(odd->rank(), rank == 3 ? 0 : rank == 1 ? 1 : -1);
    if (odd->is_member()) {
      at::Tensor t = at::full({3}, static_cast<double>(rank));
      all_reduce(*odd, t).wait();
      EXPECT_TRUE(t.equal(at::full({3}, 4.0)));
      // A group made from a group.
      auto solo = new_group(*odd, {0});
      ASSERT_TRUE(solo.ok()) << solo.status();
      EXPECT_EQ(solo->is_member(), rank == 3);
      EXPECT_THAT(solo->global_ranks(), ElementsAre(3));
    } else {
      at::Tensor t = at::ones({1});
      EXPECT_THROW(all_reduce(*odd, t), c10::Error);
      EXPECT_EQ(new_group(*odd, {0}).status().code(), absl::StatusCode::kFailedPrecondition);
    }

    // Intra/inter-node groups for nodes of 2 ranks: [0,1] [2,3] / [0,2] [1,3].
    auto nodes = init_intra_and_inter_node_groups(world, 2);
    ASSERT_TRUE(nodes.ok()) << nodes.status();
    const int node = rank / 2, local = rank % 2;
    EXPECT_THAT(nodes->intra_node.global_ranks(), ElementsAre(2 * node, 2 * node + 1));
    EXPECT_THAT(nodes->inter_node.global_ranks(), ElementsAre(local, local + 2));
    EXPECT_EQ(nodes->intra_node.rank(), local);
    EXPECT_EQ(nodes->inter_node.rank(), node);

    // 2 x 2 mesh (replicate x shard).
    auto mesh = init_hybrid_shard_mesh(world, 2, 2);
    ASSERT_TRUE(mesh.ok()) << mesh.status();
    EXPECT_EQ(mesh->ndim(), 2);
    EXPECT_THAT(mesh->coordinate(), ElementsAre(node, local));
    auto hybrid = hybrid_shard_groups(*mesh);
    ASSERT_TRUE(hybrid.ok()) << hybrid.status();
    EXPECT_THAT(hybrid->shard.global_ranks(), ElementsAre(2 * node, 2 * node + 1));
    EXPECT_THAT(hybrid->replicate.global_ranks(), ElementsAre(local, local + 2));
    EXPECT_TRUE(validate_hybrid_shard_groups(hybrid->shard, hybrid->replicate, world).ok());
    EXPECT_THAT(message(validate_hybrid_shard_groups(hybrid->shard, world, world)),
                HasSubstr("shard group size 2 x replicate group size 4: expected the "
                          "world size 4"));
    EXPECT_THAT(message(validate_hybrid_shard_groups(nodes->intra_node, hybrid->shard, world)),
                HasSubstr("expected exactly the calling rank"));

    // A mesh from an explicit rank layout: rows [3 2] [1 0].
    auto custom = DeviceMesh::create(world, {2, 2}, {3, 2, 1, 0});
    ASSERT_TRUE(custom.ok()) << custom.status();
    auto row = custom->get_group(1);
    ASSERT_TRUE(row.ok());
    EXPECT_THAT(row->global_ranks(), rank >= 2 ? ElementsAre(3, 2) : ElementsAre(1, 0));
    EXPECT_FALSE(custom->get_group(2).ok());

    // Hybrid all-reduce (reduce-scatter in the shard group, all-reduce of the
    // shard across replicas, all-gather back) equals the flat all-reduce.
    const int64_t n = 7;  // per-shard elements
    at::Tensor grad = at::arange(2 * n, at::kFloat) * (rank + 1) - rank;
    at::Tensor flat = grad.clone();
    all_reduce(world, flat).wait();
    at::Tensor shard = at::empty({n});
    reduce_scatter_tensor(hybrid->shard, shard, grad).wait();
    all_reduce(hybrid->replicate, shard).wait();
    at::Tensor rebuilt = at::empty({2 * n});
    all_gather_into_tensor(hybrid->shard, rebuilt, shard).wait();
    EXPECT_TRUE(at::allclose(rebuilt, flat)) << rebuilt << flat;
    // The same with averages.
    at::Tensor flat_avg = grad.clone();
    all_reduce(world, flat_avg, ReduceOp::kAvg).wait();
    reduce_scatter_tensor(hybrid->shard, shard, grad, ReduceOp::kAvg).wait();
    all_reduce(hybrid->replicate, shard, ReduceOp::kAvg).wait();
    all_gather_into_tensor(hybrid->shard, rebuilt, shard).wait();
    EXPECT_TRUE(at::allclose(rebuilt, flat_avg));

    // Shape errors, as PyTorch reports them.
    EXPECT_THAT(message(new_subgroups(world, 3).status()),
                HasSubstr("The world size (4) must be divisible by 'group_size=3'"));
    EXPECT_THAT(message(new_subgroups(world, 8).status()),
                HasSubstr("must not exceed the world size (4)"));
    EXPECT_THAT(message(new_subgroups(world, 0).status()), HasSubstr("must be positive"));
    EXPECT_THAT(message(init_intra_and_inter_node_groups(world, 3).status()),
                HasSubstr("num_devices_per_node=3: expected a positive divisor of the "
                          "world size 4"));
    EXPECT_THAT(message(new_group(world, {0, 4}).status()), HasSubstr("contains 4"));
    EXPECT_THAT(message(new_group(world, {1, 1}).status()), HasSubstr("lists 1 twice"));
    EXPECT_THAT(message(DeviceMesh::create(world, {3, 2}).status()),
                HasSubstr("shape (3, 2) holds 6 ranks: expected the world size 4"));
    EXPECT_THAT(message(DeviceMesh::create(world, {2, 2}, {0, 1, 2, 2}).status()),
                HasSubstr("expected each world rank in [0, 4) exactly once"));
    EXPECT_THAT(message(init_hybrid_shard_mesh(world, 3, 2).status()),
                HasSubstr("replicate_size=3 x shard_size=2"));
    auto flat_mesh = DeviceMesh::create(world, {4});
    ASSERT_TRUE(flat_mesh.ok());
    EXPECT_THAT(message(hybrid_shard_groups(*flat_mesh).status()),
                HasSubstr("Expected device_mesh to have ndim=2 but got 1"));
    auto cube = DeviceMesh::create(world, {1, 2, 2});
    ASSERT_TRUE(cube.ok());
    EXPECT_THAT(message(hybrid_shard_groups(*cube).status()),
                HasSubstr("Expected device_mesh to have ndim=2 but got 3"));
  });
}

}  // namespace
}  // namespace comm
