"""Golden values for kernels/float8_linear.h: torchao's float8 training
recipe "tensorwise" (dynamic scaling, one scale per tensor; e4m3 forward,
e5m2 gradients, torch._scaled_mm), run on the CPU by torchao itself.

Needs torchao 0.17.0 (the wheel tools/fetch_gpu_peers.sh puts in
third_party/gpu_peers/, unpacked; its float8 code is pure Python) on
PYTHONPATH and the venv's pinned torch (2.15). From the repo root:

    bash tools/fetch_gpu_peers.sh    # only when third_party/gpu_peers/ is missing
    mkdir -p /tmp/torchao && unzip -qo third_party/gpu_peers/torchao-0.17.0-*.whl -d /tmp/torchao
    PYTHONPATH=/tmp/torchao ${TORCHFSDP_HOME:-$HOME/.cache/torchfsdp-cpp}/venv/bin/python3 \
        tools/golden/float8_golden.py

It rewrites kernels/testdata/float8/golden.pt (deterministic: fixed seeds,
the CPU), a flat {str: Tensor} dict (torch.save; C++ reads it with
torch::pickle_load through //testing:golden_fixture). Float8 bits are saved
as uint8 views (.view(torch.uint8)), compared bit for bit.

  cast.<c>.input      a high-precision tensor
  cast.<c>.dtype      0: float8_e4m3fn, 1: float8_e5m2 (int64 scalar)
  cast.<c>.data       torchao's hp_tensor_to_float8_dynamic(input)._data (uint8 view)
  cast.<c>.scale      its _scale (float32 scalar; data = saturate(input * scale))

  for <c> in x_f32_e4m3, x_bf16_e4m3, g_f32_e5m2, g_bf16_e5m2, zeros_e4m3
  (amax 0: the scale is clamped), tiny_f32_e4m3 (amax 1e-20), huge_f32_e5m2
  (amax 1e30).

  <m>.x, <m>.grad_out      input [2, 16, 64] and the gradient fed to backward
  <m>.w0, <m>.b0, <m>.w1, <m>.b1   Linear(64, 48) then Linear(48, 32) (b*: bias cases)
  <m>.out                  the converted model's output [2, 16, 32]
  <m>.grad.x, <m>.grad.w0, <m>.grad.b0, <m>.grad.w1, <m>.grad.b1

  for <m> in f32_bias, f32_nobias, bf16_bias, bf16_nobias (the model and
  input in that dtype), converted with
  convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise")).

The script asserts that both linears became torchao Float8Linear (with
emulate=False, so torch._scaled_mm ran). convert_to_float8_training alone
converts every nn.Linear; what skips one whose dimensions are not multiples
of 16 (which CUDA's _scaled_mm refuses) is the module_filter_fn its callers
pass (TorchTitan's float8 converter; torchao's own auto filter for the
recipe, which also skips small layers): the script passes that dimension
check alone (the 16 test of torchao's _auto_filter_for_tensorwise) and
asserts that it leaves a Linear(64, 15) in high precision, as
kernels::Float8Linear falls back there.
"""
import os

import torch
import torchao
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "kernels", "testdata", "float8", "golden.pt")
DTYPE_CODE = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}

assert torchao.__version__.startswith("0.17.0"), torchao.__version__
assert torch.__version__.startswith("2.15"), torch.__version__


def recipe():
    config = Float8LinearConfig.from_recipe_name("tensorwise")
    assert not config.emulate and not config.round_scales_to_power_of_2
    assert config.gemm_config_output.use_fast_accum
    assert not config.gemm_config_grad_input.use_fast_accum
    assert not config.gemm_config_grad_weight.use_fast_accum
    return config


def dims_multiple_of_16(mod, fqn):
    # The dimension test of torchao's _auto_filter_for_tensorwise, without its
    # size thresholds (which would skip these small layers).
    n, k = mod.weight.shape
    return n % 16 == 0 and k % 16 == 0


def add_cast(out, name, x, float8_dtype):
    t = hp_tensor_to_float8_dynamic(x, float8_dtype, LinearMMConfig(),
                                    gemm_input_role=GemmInputRole.INPUT)
    out[f"cast.{name}.input"] = x.clone()
    out[f"cast.{name}.dtype"] = torch.tensor(DTYPE_CODE[float8_dtype])
    out[f"cast.{name}.data"] = t._data.contiguous().view(torch.uint8).clone()
    out[f"cast.{name}.scale"] = t._scale.clone()


def add_model(out, name, dtype, bias):
    g = torch.Generator().manual_seed(1234 + 10 * bias + (dtype == torch.bfloat16))
    m = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=bias), torch.nn.Linear(48, 32, bias=bias))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    m = m.to(dtype)
    x = torch.randn(2, 16, 64, generator=g).to(dtype)
    grad_out = torch.randn(2, 16, 32, generator=g).to(dtype)
    out[f"{name}.x"] = x.clone()
    out[f"{name}.grad_out"] = grad_out.clone()
    for i in (0, 1):
        out[f"{name}.w{i}"] = m[i].weight.detach().clone()
        if bias:
            out[f"{name}.b{i}"] = m[i].bias.detach().clone()

    convert_to_float8_training(m, config=recipe(), module_filter_fn=dims_multiple_of_16)
    assert all(type(layer) is Float8Linear for layer in m), m
    x = x.clone().requires_grad_()
    y = m(x)
    y.backward(grad_out)
    assert y.dtype == dtype
    out[f"{name}.out"] = y.detach().clone()
    out[f"{name}.grad.x"] = x.grad.clone()
    for i in (0, 1):
        out[f"{name}.grad.w{i}"] = m[i].weight.grad.clone()
        if bias:
            out[f"{name}.grad.b{i}"] = m[i].bias.grad.clone()


def main():
    out = {}
    g = torch.Generator().manual_seed(47)
    x = torch.randn(2, 16, 64, generator=g) * 3
    grad = torch.randn(32, 48, generator=g) * 1e-3
    add_cast(out, "x_f32_e4m3", x, torch.float8_e4m3fn)
    add_cast(out, "x_bf16_e4m3", x.to(torch.bfloat16), torch.float8_e4m3fn)
    add_cast(out, "g_f32_e5m2", grad, torch.float8_e5m2)
    add_cast(out, "g_bf16_e5m2", grad.to(torch.bfloat16), torch.float8_e5m2)
    add_cast(out, "zeros_e4m3", torch.zeros(16, 16), torch.float8_e4m3fn)
    add_cast(out, "tiny_f32_e4m3", torch.randn(16, 16, generator=g) * 1e-20, torch.float8_e4m3fn)
    add_cast(out, "huge_f32_e5m2", torch.randn(16, 16, generator=g) * 1e30, torch.float8_e5m2)

    for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        for bias in (True, False):
            add_model(out, f"{tag}_{'bias' if bias else 'nobias'}", dtype, bias)

    # torchao skips a linear with a dimension not a multiple of 16.
    odd = torch.nn.Sequential(torch.nn.Linear(64, 15))
    convert_to_float8_training(odd, config=recipe(), module_filter_fn=dims_multiple_of_16)
    assert type(odd[0]) is torch.nn.Linear, odd

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    torch.save(out, OUT)
    print(f"wrote {len(out)} tensors to {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
