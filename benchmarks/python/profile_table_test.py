"""Tests of profile_table.py on small synthetic Chrome traces written to a
temporary directory: kernel classification, the step picked by its
ProfilerStep# annotation and the launches' correlation ids, idle and overlap
on the GPU, top-level CPU ops (nesting), the table, --json and the errors.

    python3 benchmarks/python/profile_table_test.py
    bazel test //benchmarks:profile_table_test        (the same, under the venv's python)
"""

import contextlib
import gzip
import io
import json
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))
import profile_table  # noqa: E402  (beside this file)


def x(name, cat, ts, dur, tid=1, **args):
    event = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}
    if args:
        event["args"] = args
    return event


def kernel(name, ts, dur, corr, stream=7, cat="kernel"):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": stream,
            "args": {"correlation": corr}}


def launch(ts, corr):
    return x("cudaLaunchKernel", "cuda_runtime", ts, 2, correlation=corr)


# A GPU trace of two steps: step 1's kernels (correlations 1, 2) are not
# counted; step 2 (annotation [1000, 1100]) launches correlations 10..18,
# two of which run after the annotation ends. GPU intervals of step 2:
#   gemm      [1010, 1110)  100   stream 7
#   flash     [1110, 1160)   50   stream 7 (cutlass in its name: attention)
#   nccl      [1100, 1140)   40   stream 9 (overlaps gemm 10 and flash 30)
#   triton    [1200, 1220)   20   stream 7
#   memcpy    [1220, 1230)   10   stream 7
#   lpnorm    [1230, 1235)    5   (optimizer, not norm)
#   logsoftmax[1235, 1240)    5   (loss)
#   rmsnorm   [1300, 1310)   10   (norm)
#   memset    [1310, 1312)    2   (copies)
# span 1010..1312 = 302; busy = 150 (1010..1160) + 20 + 10 + 5 + 5 + 10 + 2
# = 202; idle = 100; classes sum 242, overlap 40.
GPU_EVENTS = [
    x("ProfilerStep#1", "user_annotation", 0, 100),
    launch(10, 1), launch(20, 2),
    kernel("ampere_sgemm_128x64_nn", 30, 50, 1),
    kernel("Memcpy HtoD (Pageable -> Device)", 90, 5, 2, cat="gpu_memcpy"),
    x("ProfilerStep#2", "user_annotation", 1000, 100),
    # torch.profiler's GPU-side copy of the annotation: not a step, not a kernel.
    {"ph": "X", "name": "ProfilerStep#2", "cat": "gpu_user_annotation", "ts": 1010, "dur": 302,
     "pid": 0, "tid": 7},
    x("aten::mm", "cpu_op", 1001, 5),
    *[launch(1002 + i, 10 + i) for i in range(9)],
    kernel("sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 1010, 100, 10),
    kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<cutlass::bfloat16_t>>",
           1110, 50, 11),
    kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1100,
           40, 12, stream=9),
    kernel("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0", 1200, 20, 13),
    kernel("Memcpy DtoD (Device -> Device)", 1220, 10, 14, cat="gpu_memcpy"),
    kernel("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<"
           "at::native::(anonymous namespace)::TensorListMetadata<1>, LpNormFunctor<float>>",
           1230, 5, 15),
    kernel("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
           "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", 1235, 5, 16),
    kernel("void kernels::internal::RmsNormForwardKernel<float>", 1300, 10, 17),
    kernel("Memset (Device)", 1310, 2, 18, cat="gpu_memset"),
    # A kernel with no launch in step 2 (a leftover of step 1's stream).
    kernel("ampere_sgemm_128x64_nn", 2000, 30, 3),
]

# A CPU trace (no GPU events, no annotation: the whole trace). Thread 1:
# aten::linear [0,100) holding aten::addmm [10,90) (counted once, 100, as
# GEMM); autograd's MmBackward0 [100,150) holding aten::mm (GEMM 50);
# aten::add_ [160,170) (elementwise 10); aten::view [170,171) (other 1).
# Thread 2: aten::addmm [0,50) (GEMM 50; runs beside thread 1: overlap).
# Top-level intervals: span 0..171; busy 0..150 + 160..171 = 161; idle 10;
# classes 100+50+50+10+1 = 211, overlap 211 - 161 = 50.
CPU_EVENTS = [
    x("aten::linear", "cpu_op", 0, 100),
    x("aten::t", "cpu_op", 1, 2),
    x("aten::addmm", "cpu_op", 10, 80),
    x("autograd::engine::evaluate_function: MmBackward0", "cpu_op", 100, 50),
    x("MmBackward0", "cpu_op", 101, 48),
    x("aten::mm", "cpu_op", 102, 46),
    x("aten::add_", "cpu_op", 160, 10),
    x("aten::view", "cpu_op", 170, 1),
    x("aten::addmm", "cpu_op", 0, 50, tid=2),
    {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "trainer"}},
]


class ProfileTableTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.gpu = self.write("titan.json.gz", {"traceEvents": GPU_EVENTS}, gz=True)
        self.cpu = self.write("ours.json", {"traceEvents": CPU_EVENTS})

    def write(self, name, obj, gz=False):
        path = os.path.join(self.tmp.name, name)
        data = json.dumps(obj).encode()
        with open(path, "wb") as f:
            f.write(gzip.compress(data) if gz else data)
        return path

    def run_main(self, argv):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = profile_table.main(argv)
            except SystemExit as e:  # argparse's usage errors
                code = e.code
        return code, out.getvalue(), err.getvalue()

    def test_classify(self):
        cases = {
            "sm90_xmma_gemm_bf16bf16_bf16f32": "GEMM",
            "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT": "GEMM",
            "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16>": "GEMM",
            "void at::native::_scaled_mm_kernel": "GEMM",
            "void flash::FlashAttnFwdSm90<cutlass::bfloat16_t>": "attention",
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16": "attention",
            "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
            "triton_red_fused__log_softmax_0": "fused (triton)",
            "ncclDevKernel_AllGather_RING_LL": "communication",
            "void at::native::reduce_kernel<512, 1, ReduceOp<float, MaxOps>>": "elementwise",
            "void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>": "elementwise",
            "void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>": "copies",
            "void at::native::CatArrayBatchedCopy<float, 4>": "copies",
            "void at::native::cunn_SoftMaxForward<SoftMaxForwardEpilogue>": "elementwise",
            "void at::native::nll_loss_forward_reduce_cuda_kernel_2d": "loss",
            "void at::native::vectorized_layer_norm_kernel<float>": "norm",
            "void at::native::(anonymous)::distribution_elementwise_grid_stride_kernel"
            "<normal_kernel>": "elementwise",
            "void at::native::fused_adam_kernel": "optimizer",
            "SwiGluForwardKernel": "elementwise",
            # Names seen in an H200 trace of LibTorch 2.11: {lambda()#2} is
            # not the LAMB optimizer.
            "void at::native::vectorized_elementwise_kernel<8, at::native::"
            "GeluBackwardCUDAKernelImpl(at::TensorIteratorBase&)::{lambda()#2}>": "elementwise",
            "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
            "at::TensorIteratorBase&)::{lambda()#3}::operator()() const>": "copies",
            "void at::native::reduce_kernel<128, 4, at::native::ReduceOp<c10::BFloat16, "
            "func_wrapper_t<c10::BFloat16, sum_functor<c10::BFloat16>>>": "elementwise",
            "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate"
            "<c10::BFloat16, float>": "norm",
            "void at::native::lpnorm_cleanup<float, (at::native::NormType)2, float>": "optimizer",
            "cudnn::fusion::compute_dot_do_o_specialized<true, 64>": "attention",
            "some_custom_kernel": "other",
        }
        for name, expected in cases.items():
            with self.subTest(name=name):
                self.assertEqual(profile_table.classify(name, "kernel"), expected)
        self.assertEqual(profile_table.classify("Memcpy HtoD", "gpu_memcpy"), "copies")
        self.assertEqual(profile_table.classify("Memset (Device)", "gpu_memset"), "copies")
        cpu = {
            "aten::mm": "GEMM", "aten::addmm": "GEMM", "aten::bmm": "GEMM",
            "aten::linear": "GEMM", "aten::matmul": "GEMM",
            "autograd::engine::evaluate_function: AddmmBackward0": "GEMM",
            "aten::scaled_dot_product_attention": "attention",
            "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
            "autograd::engine::evaluate_function: "
            "ScaledDotProductFlashAttentionForCpuBackward0": "attention",
            "aten::cross_entropy_loss": "loss",
            "autograd::engine::evaluate_function: NllLossBackward0": "loss",
            "aten::layer_norm": "norm", "aten::rms_norm": "norm",
            "aten::_fused_adamw_": "optimizer", "aten::_foreach_add_": "optimizer",
            "c10d::_allgather_base_": "communication", "c10d::allreduce_": "communication",
            "aten::copy_": "copies", "aten::_to_copy": "copies", "aten::cat": "copies",
            "aten::add_": "elementwise", "aten::gelu": "elementwise",
            "autograd::engine::evaluate_function: AddBackward0": "elementwise",
            "aten::view": "other", "aten::embedding": "other",
            "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad": "other",
        }
        for name, expected in cpu.items():
            with self.subTest(name=name):
                self.assertEqual(profile_table.classify(name, "cpu_op"), expected)

    def test_op_base_name(self):
        self.assertEqual(profile_table.op_base_name("aten::addmm"), "addmm")
        self.assertEqual(profile_table.op_base_name(
            "autograd::engine::evaluate_function: NativeLayerNormBackward0"), "native_layer_norm")
        self.assertEqual(profile_table.op_base_name(
            "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"),
            "accumulate_grad")
        # kernels::Linear's backward node: its products are the GEMM class.
        linear_node = ("autograd::engine::evaluate_function: torch::autograd::CppNode<"
                       "kernels::(anonymous namespace)::LinearFunction>")
        self.assertEqual(profile_table.op_base_name(linear_node), "linear")
        self.assertEqual(profile_table.classify(linear_node, "cpu_op"), "GEMM")
        self.assertEqual(profile_table.classify("kernels::onednn_matmul", "cpu_op"), "GEMM")

    def test_gpu_step_classes_idle_and_overlap(self):
        r = profile_table.summarize("titan", self.gpu)
        self.assertEqual(r["mode"], "GPU kernels")
        self.assertEqual(r["step"], "ProfilerStep#2")
        self.assertEqual(r["events"], 9)  # not step 1's, not the unlaunched one
        c = r["classes_ms"]
        self.assertAlmostEqual(c["GEMM"], 0.100)
        self.assertAlmostEqual(c["attention"], 0.050)
        self.assertAlmostEqual(c["communication"], 0.040)
        self.assertAlmostEqual(c["fused (triton)"], 0.020)
        self.assertAlmostEqual(c["copies"], 0.012)
        self.assertAlmostEqual(c["optimizer"], 0.005)
        self.assertAlmostEqual(c["loss"], 0.005)
        self.assertAlmostEqual(c["norm"], 0.010)
        self.assertAlmostEqual(c["other"], 0.0)
        self.assertAlmostEqual(r["total_ms"], 0.302)
        self.assertAlmostEqual(r["idle_ms"], 0.100)
        self.assertAlmostEqual(r["overlap_ms"], 0.040)
        self.assertAlmostEqual(sum(c.values()) + r["idle_ms"] - r["overlap_ms"], r["total_ms"])
        self.assertEqual(r["top"][0]["class"], "GEMM")
        self.assertAlmostEqual(r["top"][0]["ms"], 0.100)

    def test_gpu_step_without_correlation_ids_starts_at_the_annotation(self):
        events = [dict(e) for e in GPU_EVENTS]
        for e in events:
            e.pop("args", None)
        r = profile_table.summarize("t", self.write("nocorr.json", {"traceEvents": events}))
        # From step 2's start on: its 9 kernels and the later leftover.
        self.assertEqual(r["events"], 10)
        self.assertAlmostEqual(r["classes_ms"]["GEMM"], 0.130)

    def test_cpu_top_level_ops(self):
        r = profile_table.summarize("ours", self.cpu)
        self.assertEqual(r["mode"], "CPU ops")
        self.assertEqual(r["step"], "the whole trace")
        self.assertEqual(r["events"], 5)
        c = r["classes_ms"]
        self.assertAlmostEqual(c["GEMM"], 0.200)  # linear 100 + MmBackward0 50 + thread 2's 50
        self.assertAlmostEqual(c["elementwise"], 0.010)
        self.assertAlmostEqual(c["other"], 0.001)
        self.assertAlmostEqual(r["total_ms"], 0.171)
        self.assertAlmostEqual(r["idle_ms"], 0.010)
        self.assertAlmostEqual(r["overlap_ms"], 0.050)

    def test_cpu_ops_inside_the_last_step_only(self):
        events = CPU_EVENTS + [x("ProfilerStep#7", "user_annotation", 95, 80),
                               x("aten::mm", "cpu_op", 500, 40)]
        r = profile_table.summarize("ours", self.write("steps.json", {"traceEvents": events}))
        self.assertEqual(r["step"], "ProfilerStep#7")
        # MmBackward0, add_, view: the ops before 95 and after 175 are out.
        self.assertEqual(r["events"], 3)
        self.assertAlmostEqual(r["classes_ms"]["GEMM"], 0.050)

    def test_table_and_json(self):
        out_json = os.path.join(self.tmp.name, "out.json")
        code, out, err = self.run_main(
            ["--trace", f"ours={self.cpu}", "--trace", f"titan={self.gpu}", "--json", out_json])
        self.assertEqual(code, 0, err)
        self.assertIn("ours ms", out)
        self.assertIn("titan ms", out)
        self.assertIn("ours/titan", out)
        self.assertIn("(CPU ops, the whole trace, 5 events)", out)
        self.assertIn("(GPU kernels, ProfilerStep#2, 9 events)", out)
        self.assertIn("warning: GPU kernels and CPU ops side by side", out)
        self.assertIn("top 9 kernels of titan:", out)
        self.assertIn("top 5 top-level CPU ops of ours:", out)
        gemm = next(line for line in out.splitlines() if line.startswith("GEMM "))
        self.assertEqual(gemm.split()[1:], ["0.200", "117.0", "0.100", "33.1", "2.00"])
        idle = next(line for line in out.splitlines() if line.startswith("idle "))
        self.assertEqual(idle.split()[1:], ["0.010", "5.8", "0.100", "33.1", "0.10"])
        with open(out_json) as f:
            figures = json.load(f)
        self.assertEqual(list(figures), ["ours", "titan"])
        self.assertAlmostEqual(figures["titan"]["idle_ms"], 0.100)

    def test_errors_name_the_trace(self):
        missing = os.path.join(self.tmp.name, "missing.json")
        not_json = self.write("bad.json", {})
        with open(not_json, "w") as f:
            f.write("{not json")
        no_events = self.write("noevents.json", {"schemaVersion": 1})
        empty = self.write("empty.json", {"traceEvents": [x("ProfilerStep#1", "user_annotation",
                                                          0, 10)]})
        bad_gz = os.path.join(self.tmp.name, "bad.json.gz")
        with open(bad_gz, "wb") as f:
            f.write(b"\x1f\x8b\x08garbage")
        for path, words in [(missing, "cannot read it"), (not_json, "not JSON"),
                            (no_events, "\"traceEvents\""), (empty, "in ProfilerStep#1"),
                            (bad_gz, "does not decompress")]:
            with self.subTest(path=path):
                code, out, err = self.run_main(["--trace", f"ours={self.cpu}",
                                                "--trace", f"titan={path}"])
                self.assertEqual(code, 1)
                self.assertIn(path, err)
                self.assertIn(words, err)
                self.assertEqual(out, "")
        code, _, err = self.run_main(["--trace", "ours"])
        self.assertEqual(code, 2)
        self.assertIn("expected NAME=PATH", err)
        code, _, err = self.run_main(["--trace", f"a={self.cpu}", "--trace", f"a={self.gpu}"])
        self.assertEqual(code, 2)
        self.assertIn("expected distinct names", err)


if __name__ == "__main__":
    unittest.main()
