// Each collective on real ranks against a single-process reference, for
// float32 / float64 / bfloat16 and odd sizes; argument errors; async
// handles.
#include "comm/collectives.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/allclose.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "launcher/launch.h"
#include "testing/multiprocess.h"

namespace comm {
namespace {

using ::testing::HasSubstr;

// Rank r's input of n elements. Small integers and halves: exact in bfloat16,
// so every dtype has an exact reference.
at::Tensor input_of(int rank, int64_t n, at::ScalarType dtype) {
  return (at::arange(n, at::kDouble) * (rank % 2 ? -1 : 1) + rank * 1.5 - (n % 5)).to(dtype);
}

at::Tensor reduce_reference(const std::vector<at::Tensor>& per_rank, ReduceOp op) {
  at::Tensor stacked = at::stack(per_rank).to(at::kDouble);
  switch (op) {
    case ReduceOp::kSum: return stacked.sum(0);
    case ReduceOp::kAvg: return stacked.mean(0);
    case ReduceOp::kMax: return std::get<0>(stacked.max(0));
    case ReduceOp::kMin: return std::get<0>(stacked.min(0));
  }
  return {};
}

void expect_close(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  // Sums of small integers and halves are exact; averages over 3 ranks are
  // rounded once (bfloat16 keeps 8 bits).
  const double tol = actual.scalar_type() == at::kBFloat16 ? 1e-2
                     : actual.scalar_type() == at::kFloat  ? 1e-6
                                                           : 1e-12;
  EXPECT_TRUE(at::allclose(actual.to(at::kDouble), expected.to(at::kDouble), tol, tol))
      << what << "\nactual:   " << actual << "\nexpected: " << expected;
}

void check_all_collectives(ProcessGroup& pg) {
  const int world = pg.size();
  const int rank = pg.rank();
  for (at::ScalarType dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
    for (int64_t n : {1, 5, 7}) {  // shards of odd length; totals world*n
      const std::string where = std::string(c10::toString(dtype)) + " n=" + std::to_string(n) +
                                " world=" + std::to_string(world);
      std::vector<at::Tensor> inputs;
      for (int r = 0; r < world; ++r) inputs.push_back(input_of(r, n, dtype));

      // all_gather_into_tensor
      at::Tensor gathered = at::empty({world * n}, dtype);
      all_gather_into_tensor(pg, gathered, inputs[rank]).wait();
      EXPECT_TRUE(gathered.equal(at::cat(inputs))) << "all_gather " << where;

      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
        const std::string what = std::string(reduce_op_name(op)) + " " + where;
        // reduce_scatter_tensor: rank r's flat input is the concatenation of
        // world chunks; the reference reduces chunk `rank` over ranks.
        std::vector<at::Tensor> flat_inputs, my_chunks;
        for (int r = 0; r < world; ++r) {
          flat_inputs.push_back(input_of(r + 10, world * n, dtype));
          my_chunks.push_back(flat_inputs[r].narrow(0, rank * n, n));
        }
        at::Tensor scattered = at::empty({n}, dtype);
        reduce_scatter_tensor(pg, scattered, flat_inputs[rank], op).wait();
        expect_close(scattered, reduce_reference(my_chunks, op), "reduce_scatter " + what);

        // all_reduce over a length not divisible by the world size.
        const int64_t len = world * n + 1;
        std::vector<at::Tensor> full;
        for (int r = 0; r < world; ++r) full.push_back(input_of(r, len, dtype));
        at::Tensor reduced = full[rank].clone();
        all_reduce(pg, reduced, op).wait();
        expect_close(reduced, reduce_reference(full, op), "all_reduce " + what);
      }

      // broadcast from the last rank.
      at::Tensor b = input_of(rank, n + 2, dtype);
      broadcast(pg, b, world - 1).wait();
      EXPECT_TRUE(b.equal(input_of(world - 1, n + 2, dtype))) << "broadcast " << where;

      // send / recv around a ring (every rank sends and receives at once),
      // then every other rank to rank 0 on two tags posted out of order.
      at::Tensor from_left = at::empty({n + 1}, dtype);
      const int left = (rank + world - 1) % world;
      Work sent = send(pg, input_of(rank, n + 1, dtype), (rank + 1) % world);
      recv(pg, from_left, left).wait();
      sent.wait();
      EXPECT_TRUE(from_left.equal(input_of(left, n + 1, dtype))) << "ring recv " << where;
      if (rank == 0) {
        for (int src = 1; src < world; ++src) {
          at::Tensor second = at::empty({n}, dtype);
          at::Tensor first = at::empty({n}, dtype);
          Work w2 = recv(pg, second, src, /*tag=*/2);
          recv(pg, first, src, /*tag=*/1).wait();
          w2.wait();
          EXPECT_TRUE(first.equal(input_of(src, n, dtype))) << "tag 1 from " << src << where;
          EXPECT_TRUE(second.equal(input_of(src + 5, n, dtype))) << "tag 2 from " << src << where;
        }
      } else {
        send(pg, input_of(rank, n, dtype), 0, /*tag=*/1).wait();
        send(pg, input_of(rank + 5, n, dtype), 0, /*tag=*/2).wait();
      }
    }
  }
  barrier(pg).wait();
}

TEST(Work, DefaultIsCompletedAndWaitsAtOnce) {
  comm::Work work;
  EXPECT_TRUE(work.is_completed());
  work.wait();  // no timeout of its own: returns, does not throw
  work.wait(std::chrono::milliseconds(1));
  work.wait_on_stream();
}

TEST(Collectives, MatchReferenceOnTwoRanks) {
  testing::RunOnRanks(2, [](ProcessGroup& pg) { check_all_collectives(pg); });
}

TEST(Collectives, MatchReferenceOnThreeRanks) {
  testing::RunOnRanks(3, [](ProcessGroup& pg) { check_all_collectives(pg); });
}

TEST(Collectives, AsyncHandlesOverlapAndWaitInAnyOrder) {
  testing::RunOnRanks(2, [](ProcessGroup& pg) {
    at::Tensor a = at::full({1000}, pg.rank() + 1.0);
    at::Tensor b = at::full({3}, pg.rank() * 10.0);
    at::Tensor gathered = at::empty({6});
    Work wa = all_reduce(pg, a);
    Work wb = all_gather_into_tensor(pg, gathered, b);
    Work wc = barrier(pg);
    // Compute while the collectives run.
    at::Tensor busy = at::matmul(at::ones({64, 64}), at::ones({64, 64}));
    EXPECT_EQ(busy[0][0].item<float>(), 64.0f);
    wc.wait();
    wb.wait();
    wa.wait(std::chrono::seconds(10));
    EXPECT_TRUE(wa.is_completed());
    wa.wait();  // idempotent
    EXPECT_TRUE(a.equal(at::full({1000}, 3.0)));
    EXPECT_TRUE(gathered.equal(at::cat({at::zeros({3}), at::full({3}, 10.0)})));
  });
}

// Gloo's sends and receives report completion only once waited for (c10d's
// SendWork/RecvWork); comm's is_completed() must still turn true by polling
// alone, as the FSDP runtime polls: for send/recv and for the rank-to-rank
// all-gather built from them. Without that, this loop spins until its
// deadline (20 s, far beyond a loopback message).
bool poll_until_completed(const Work& work) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (!work.is_completed()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(Work, PollingCompletesSendsReceivesAndRankToRankGathers) {
  testing::RunOnRanks(2, [](ProcessGroup& pg) {
    const int peer = 1 - pg.rank();
    at::Tensor mine = at::full({1000}, pg.rank() + 1.0);
    at::Tensor theirs = at::empty({1000});
    Work received = recv(pg, theirs, peer, /*tag=*/5);
    Work sent = send(pg, mine, peer, /*tag=*/5);
    EXPECT_TRUE(poll_until_completed(received));
    EXPECT_TRUE(poll_until_completed(sent));
    received.wait();  // returns what the polling thread saw
    sent.wait();
    EXPECT_TRUE(theirs.equal(at::full({1000}, peer + 1.0)));

    constexpr int64_t kBig = 300001;  // x 2 ranks x 4 bytes > 1 MiB: rank to rank
    ASSERT_TRUE(all_gathers_rank_to_rank(pg, c10::Device(c10::kCPU), 2 * kBig * 4));
    at::Tensor input = at::full({kBig}, pg.rank() * 2.0);
    at::Tensor gathered = at::empty({2 * kBig});
    Work gather = all_gather_into_tensor(pg, gathered, input);
    EXPECT_TRUE(poll_until_completed(gather));
    gather.wait();
    EXPECT_TRUE(gathered.equal(at::cat({at::zeros({kBig}), at::full({kBig}, 2.0)})));
    // A Work dropped while its polling thread still waits is released by
    // that thread; the group stays usable.
    at::Tensor unused = at::empty({1000});
    {
      Work late = recv(pg, unused, peer, /*tag=*/6);
      (void)late.is_completed();  // starts the polling thread
    }
    send(pg, mine, peer, /*tag=*/6).wait();
    barrier(pg).wait();
  });
}

// Gathers of 1 MiB and more on Gloo go rank to rank (sends and receives
// straight into the output); several in flight at once must each get their
// own pieces. float32 and bfloat16; one list gather mixes both dtypes and
// sizes, one stays under 1 MiB (one collective per pair).
void check_large_gathers(ProcessGroup& pg) {
  const int world = pg.size();
  const int rank = pg.rank();
  const std::string where = " world=" + std::to_string(world);
  constexpr int64_t kBig = 300001;  // x world x 2 bytes > 1 MiB
  std::vector<at::Tensor> floats, halves;
  for (int r = 0; r < world; ++r) {
    floats.push_back(input_of(r, kBig, at::kFloat));
    halves.push_back(input_of(r + 3, kBig, at::kBFloat16));
  }
  at::Tensor gathered_f = at::empty({world * kBig}, at::kFloat);
  at::Tensor gathered_h = at::empty({world * kBig}, at::kBFloat16);
  Work wf = all_gather_into_tensor(pg, gathered_f, floats[rank]);
  Work wh = all_gather_into_tensor(pg, gathered_h, halves[rank]);
  wh.wait();
  wf.wait();
  EXPECT_TRUE(gathered_f.equal(at::cat(floats))) << "float32" << where;
  EXPECT_TRUE(gathered_h.equal(at::cat(halves))) << "bfloat16" << where;

  for (int64_t scale : {int64_t{1}, int64_t{1000}}) {  // ~1 KiB and ~1 MiB in all
    std::vector<int64_t> sizes = {7 * scale, 1, 130 * scale, 3};
    std::vector<at::ScalarType> dtypes = {at::kFloat, at::kBFloat16, at::kDouble, at::kFloat};
    std::vector<at::Tensor> inputs, outputs;
    std::vector<std::vector<at::Tensor>> per_rank(sizes.size());
    for (size_t k = 0; k < sizes.size(); ++k) {
      for (int r = 0; r < world; ++r) {
        per_rank[k].push_back(input_of(r + static_cast<int>(k), sizes[k], dtypes[k]));
      }
      inputs.push_back(per_rank[k][rank]);
      outputs.push_back(at::empty({world * sizes[k]}, dtypes[k]));
    }
    Work first = all_gather_into_tensors(pg, outputs, inputs);
    // A second list in flight behind the first, into other outputs.
    std::vector<at::Tensor> again;
    for (const at::Tensor& o : outputs) again.push_back(at::empty_like(o));
    Work second = all_gather_into_tensors(pg, again, inputs);
    second.wait();
    first.wait();
    for (size_t k = 0; k < sizes.size(); ++k) {
      const std::string what = "all_gather_into_tensors[" + std::to_string(k) + "] scale " +
                               std::to_string(scale) + where;
      EXPECT_TRUE(outputs[k].equal(at::cat(per_rank[k]))) << what;
      EXPECT_TRUE(again[k].equal(at::cat(per_rank[k]))) << what << " (second)";
    }
  }
  barrier(pg).wait();
}

TEST(Collectives, LargeGathersGoRankToRankOnTwoRanks) {
  testing::RunOnRanks(2, [](ProcessGroup& pg) { check_large_gathers(pg); });
}

TEST(Collectives, LargeGathersGoRankToRankOnFourRanks) {
  testing::RunOnRanks(4, [](ProcessGroup& pg) { check_large_gathers(pg); });
}

// Argument checks run before anything is sent: one process is enough.
TEST(Collectives, BadArgumentsAreClearErrors) {
  auto port = launcher::pick_free_port();
  ASSERT_TRUE(port.ok());
  InitOptions init;
  init.init_method = "tcp://127.0.0.1:" + std::to_string(*port);
  init.rank = 0;
  init.world_size = 1;
  init.timeout = std::chrono::seconds(10);
  auto pg = init_process_group(init);
  ASSERT_TRUE(pg.ok()) << pg.status();

  auto message = [](auto&& f) -> std::string {
    try {
      f();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "<no error>";
  };
  const at::Tensor v = at::ones({4});
  EXPECT_THAT(message([&] {
                all_reduce(*pg, at::ones({2, 2}));
              }),
              HasSubstr("tensor has shape [2, 2]: expected a 1-D"));
  EXPECT_THAT(message([&] {
                all_reduce(*pg, at::ones({4, 2}).select(1, 0));
              }),
              HasSubstr("tensor is not contiguous"));
  EXPECT_THAT(message([&] { all_gather_into_tensor(*pg, at::empty({5}), v); }),
              HasSubstr("output has 5 elements: expected group size 1 x input's 4 = 4"));
  EXPECT_THAT(message([&] { all_gather_into_tensor(*pg, at::empty({4}, at::kDouble), v); }),
              HasSubstr("output has dtype Double: expected the input's dtype Float"));
  EXPECT_THAT(message([&] { all_gather_into_tensors(*pg, {at::empty({4})}, {}); }),
              HasSubstr("1 outputs for 0 inputs: expected one output per input"));
  EXPECT_THAT(message([&] {
                all_gather_into_tensors(*pg, {at::empty({4}), at::empty({3})}, {v, v});
              }),
              HasSubstr("outputs[1] has 3 elements: expected group size 1 x input's 4"));
  EXPECT_THAT(message([&] { send(*pg, v, 0, kMaxTag + 1); }),
              HasSubstr("send: tag=1073741824: expected 0 <= tag <= 1073741823"));
  EXPECT_THAT(message([&] { reduce_scatter_tensor(*pg, at::empty({3}), v); }),
              HasSubstr("input has 4 elements: expected group size 1 x output's 3 = 3"));
  EXPECT_THAT(message([&] { broadcast(*pg, v, 1); }),
              HasSubstr("root=1: expected a rank of the group in [0, 1)"));
  EXPECT_THAT(message([&] { send(*pg, v, 1); }),
              HasSubstr("send: dst=1: expected a rank of the group in [0, 1)"));
  EXPECT_THAT(message([&] { recv(*pg, v, 0); }),
              HasSubstr("recv: src=0 is this rank: expected another rank"));
  EXPECT_THAT(message([&] { all_reduce(*pg, at::ones({4}, at::kLong), ReduceOp::kAvg); }),
              HasSubstr("ReduceOp avg on dtype Long"));
  EXPECT_THAT(message([&] { all_reduce(*pg, at::ones({4}, at::kComplexFloat)); }),
              HasSubstr("has dtype ComplexFloat"));
  EXPECT_THAT(message([&] { all_reduce(ProcessGroup(), v); }),
              HasSubstr("is not a member of group"));
  EXPECT_THAT(message([&] { all_reduce(*pg, v).wait(std::chrono::milliseconds(0)); }),
              HasSubstr("timeout=0 ms"));

  // A one-rank world still runs every collective.
  at::Tensor out = at::empty({4});
  reduce_scatter_tensor(*pg, out, at::arange(4.0), ReduceOp::kAvg).wait();
  EXPECT_TRUE(out.equal(at::arange(4.0)));
  at::Tensor flags = at::zeros({2}, at::kBool);
  flags[0] = true;
  const at::Tensor expected_flags = flags.clone();
  broadcast(*pg, flags).wait();
  EXPECT_TRUE(flags.equal(expected_flags));
}

}  // namespace
}  // namespace comm
