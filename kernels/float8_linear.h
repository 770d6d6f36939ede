// A linear layer with float8 matrix products: torchao's float8 training
// recipe "tensorwise" (torchao 0.17.0, torchao/float8/; TorchTitan's
// `--model.converters quantize.linear.float8`), for LibTorch.
//
//   if (std::string why; !kernels::Float8MatmulSupported(device, &why)) refuse(why);
//   at::Tensor y = kernels::Float8Linear(x, weight, bias);   // F::linear(x, weight, bias)
//
// Dynamic scaling, one scale per tensor, recomputed at every call: each
// operand of the three matrix products of a linear is cast to float8 with
// CastToFloat8 (activations and weights to e4m3 for the forward, the output
// gradient to e5m2, whose range gradients need), and multiplied by
// at::_scaled_mm, which takes the inverse scales and returns the product in
// the input's dtype:
//
//   out         = _scaled_mm(x_e4m3 [M,K], w_e4m3.t() [K,N], fast accumulation)
//   grad_input  = _scaled_mm(g_e5m2 [M,N], w_e4m3 [N,K])            exact accumulation
//   grad_weight = _scaled_mm(g_e5m2.t() [N,M], x_e4m3 [M,K])        exact accumulation
//
// with x the input flattened to [M = rows, K] (leading dims restored on the
// way out) and the bias added afterwards in the output's dtype, as torchao's
// Float8Linear adds it. The results are torchao's bit for bit on the CPU
// (float32 and bfloat16; float8_linear_test against tools/golden/
// float8_golden.py). Unlike torchao, which saves the high-precision input
// and weight and casts them again in backward, this op saves their float8
// casts (the same bits: the cast is a function of the tensor alone), 1 byte
// an element, transposed as the backward's products take them.
//
// The casts: on CUDA (a binary that links //kernels:cuda) each tensor's is
// two kernels, amax then one fused pass that computes the scale on the
// device (no host synchronisation), writes the float8 bytes and, in the
// same pass, the transposed bytes the backward's product takes
// (internal/cuda_kernels.h; reference::CastToFloat8Tensorwise is its
// arithmetic on the CPU). Only those transposed bytes are saved for
// backward. Elsewhere (the CPU; CUDA without //kernels:cuda, which warns
// once) the casts are CastToFloat8 below, the same bits.
//
// Where it runs fast: CUDA with compute capability 8.9 or later (Ada,
// Hopper, Blackwell), the devices with float8 tensor cores;
// Float8MatmulSupported says so and why not. Elsewhere at::_scaled_mm may
// still run (ATen 2.15 has a CPU implementation, which the tests use to
// check the numerics) but gains nothing.
//
// Shapes: CUDA's _scaled_mm needs every dimension of both operands a
// multiple of 16 (and the first operand row-major, the second column-major,
// which this op arranges). A call whose M, K or N is not (or is zero) runs
// the high-precision at::linear instead and warns once per process per
// shape, as TorchTitan's converter leaves such linears unconverted.
#pragma once

#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

namespace kernels {

// A tensor cast to float8 with its scale: data ≈ saturate(x * scale).
struct Float8Tensor {
  at::Tensor data;       // float8_dtype, x's shape
  at::Tensor scale;      // float32 scalar: float8_max / max(amax(x), 1e-12)
  at::Tensor inv_scale;  // float32 scalar 1 / scale (x ≈ data * inv_scale): _scaled_mm's scale_a/b
  at::ScalarType orig_dtype;  // x's dtype
};

// torchao's tensorwise dynamic cast (hp_tensor_to_float8_dynamic, with
// round_scales_to_power_of_2 false), in torchao's order of operations so
// the bits are the same:
//   amax  = max(|x|)                                     (in x's dtype: exact)
//   scale = float32(float8_max * (1 / max(float64(amax), 1e-12)))   (in float64)
//   data  = clamp(float32(x) * scale, -float8_max, float8_max).to(float8_dtype)
//   inv_scale = 1 / scale                                (float32)
// x: a non-empty floating tensor (not float8) on any device; float8_dtype:
// Float8_e4m3fn, Float8_e5m2, Float8_e4m3fnuz or Float8_e5m2fnuz. Not
// differentiable (computed without autograd). No host synchronisation. ATen
// operators on every device (abs, max, upcast, multiply, clamp, cast): the
// recipe Float8Linear's fused CUDA cast is held to.
Float8Tensor CastToFloat8(const at::Tensor& x, at::ScalarType float8_dtype);

// The same cast with amax given instead of computed: torchao's reduce_amax,
// where x is one rank's shard of a tensor and `amax` max(|x|) over all the
// shards (an all-reduce MAX of each one's), so every shard is cast with the
// scale of the whole and the shards' bytes together are the whole's cast,
// bit for bit. amax: one high-precision floating element on x's device.
Float8Tensor CastToFloat8(const at::Tensor& x, at::ScalarType float8_dtype, const at::Tensor& amax);

// CastToFloat8(x, float8_dtype, amax), the same bits, computed as
// Float8Linear casts: on CUDA (a binary that links //kernels:cuda) by the
// fused kernel in one pass over x, the scale on the device (without it, the
// ATen recipe and a warning, once); elsewhere by the ATen recipe. What
// fully_shard's float8 all-gather casts each shard with.
Float8Tensor CastToFloat8Fused(const at::Tensor& x, at::ScalarType float8_dtype,
                               const at::Tensor& amax);

// F::linear(input, weight, bias) with float8 matrix products (see the top of
// this file); an autograd function of input and weight (bias by ATen's own
// add). input [..., K] and weight [N, K] float32, bfloat16 or float16 on one
// device; bias [N] or none. The output has input's dtype and shape [..., N].
// Differentiable once (backward with create_graph=true is an error).
at::Tensor Float8Linear(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias);

// The same with the weight's cast given (torchao's Float8TrainingTensor
// weight, as fully_shard's float8 all-gather delivers it:
// fsdp::float8_unsharded_param): weight_cast.data (Float8_e4m3fn, weight's
// shape and device) and inv_scale are multiplied as they are, and weight's
// values are never read; weight is the autograd input its gradient (in
// weight's dtype) goes to. The cast's data is saved for backward as it is
// (no transposed copy held between forward and backward; the backward
// makes one), so its owner may free and refill that memory in between, as
// fully_shard does. Where the shape falls back to at::linear, the weight
// used is the cast's dequantized values (data * inv_scale), and the
// gradient still goes to weight.
at::Tensor Float8Linear(const at::Tensor& input, const at::Tensor& weight,
                        const Float8Tensor& weight_cast, const std::optional<at::Tensor>& bias);

// Whether `device` has float8 matrix products that pay: CUDA with compute
// capability >= 8.9. When not, false, and `why` (if not null) says why, e.g.
// "the CPU has no float8 matrix products ...". The capability is asked
// through //kernels:cuda (linked under --config=cuda), so that //kernels
// builds without CUDA; a CUDA device in a binary without it is refused with
// that reason.
bool Float8MatmulSupported(const c10::Device& device, std::string* why);

}  // namespace kernels
