"""Float32 transcendentals lowered for a TPU ask for XLA's accurate forms under HIGHEST precision
(``runtime/tpu_accuracy.py``), and only then; the CPU lowering is JAX's own. The programs are
lowered for the TPU platform with ``jax.export`` (no TPU or libtpu needed): what is checked is the
StableHLO a TPU would compile."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu.device import dtypes
from torchtpu.jax import to_jax

ACCURATE = "result_accuracy_mode<HIGHEST>"


class _Transcendentals(torch.nn.Module):
    def forward(self, x):
        return (x.log() + x.exp() * torch.tanh(x) + torch.sigmoid(x) + x.sin() + x.rsqrt()
                + torch.log_softmax(x, -1))


def _stablehlo(dtype, platform: str) -> str:
    fn, params = to_jax(_Transcendentals())
    spec = jax.ShapeDtypeStruct((4, 8), dtypes.to_jax(dtype))
    return jax.export.export(jax.jit(fn), platforms=[platform])(params, spec).mlir_module()


def _accurate_ops(text: str) -> int:
    return sum(ACCURATE in line for line in text.splitlines() if "= stablehlo." in line)


def test_float32_transcendentals_ask_a_tpu_for_their_accurate_forms():
    # log, exp, tanh, logistic, sin, rsqrt, and log_softmax's own exp and log: 8 ops.
    assert _accurate_ops(_stablehlo(torch.float32, "tpu")) >= 8
    assert _accurate_ops(_stablehlo(torch.float32, "cpu")) == 0


@pytest.mark.parametrize("mode", ["HIGH", "DEFAULT"])
def test_lower_precision_keeps_the_tpus_fast_forms(mode):
    with torch.tpu.precision(getattr(torch.tpu.Precision, mode)):
        assert _accurate_ops(_stablehlo(torch.float32, "tpu")) == 0
    assert _accurate_ops(_stablehlo(torch.float32, "tpu")) >= 8  # the setting is scoped


def test_half_precision_values_keep_the_fast_forms():
    # Only log_softmax's exp and log ask: torch computes a bf16 log_softmax in float32.
    text = _stablehlo(torch.bfloat16, "tpu")
    accurate = [line for line in text.splitlines() if ACCURATE in line and "= stablehlo." in line]
    assert len(accurate) == 2 and all("xf32>" in line for line in accurate)


def test_an_explicit_accuracy_is_kept():
    f = jax.jit(lambda x: jax.lax.exp(x, accuracy=jax.lax.Tolerance(atol=1e-3, rtol=0, ulps=0)))
    text = jax.export.export(f, platforms=["tpu"])(jnp.ones(3, jnp.float32)).mlir_module()
    assert "atol = 1.000000e-03" in text and ACCURATE not in text


_COMPOSED = ("asinh", "acosh", "atanh", "lgamma", "digamma")


def _chlo_and_accurate(platform: str) -> tuple[bool, int]:
    f = jax.jit(lambda x: [getattr(jax.lax, name)(x) for name in _COMPOSED])
    text = jax.export.export(f, platforms=[platform])(jnp.ones(3, jnp.float32)).mlir_module()
    return "chlo." in text, _accurate_ops(text)


def test_inverse_hyperbolics_and_the_gamma_family_are_built_from_accurate_logs_on_a_tpu():
    # XLA would expand CHLO's forms into its fast logs (lgamma 1e-4 off CPU on a v5e chip).
    chlo, accurate = _chlo_and_accurate("tpu")
    assert not chlo and accurate >= len(_COMPOSED)
    with torch.tpu.precision(torch.tpu.Precision.DEFAULT):
        assert _chlo_and_accurate("tpu") == (True, 0)
    assert _chlo_and_accurate("cpu") == (True, 0)


def _samples(name: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 3, 4000), rng.uniform(-40, 40, 2000),
                        10 ** rng.uniform(-8, 30, 1000), -(10 ** rng.uniform(-8, 5, 1000)),
                        [-0.0, 1.0, 2.0, -1.0, -2.0, -3.5, 0.5, 1e-30, 1e38, 3e38, np.inf,
                         -np.inf, np.nan, 1.0000001, 0.9999999, -0.9999999]])
    return (np.clip(x / 40, -1.5, 1.5) if name == "atanh" else x).astype(np.float32)


@pytest.mark.parametrize("name", _COMPOSED)
def test_the_composed_forms_agree_with_cpu(name):
    """The forms a TPU gets, run here: within a few float32 ulps of CPU's float64 values (relative,
    absolute below 1), and NaN / infinity where CPU's float32 has them (digamma's poles at 0 are
    the lowering table's: JAX's NaN)."""
    from torchtpu.runtime import tpu_composites

    x = _samples(name)
    ours = np.asarray(jax.jit(tpu_composites.COMPOSITES[name])(jnp.asarray(x))).astype(np.float64)
    exact = getattr(torch, name)(torch.from_numpy(x).double()).numpy()
    cpu = getattr(torch, name)(torch.from_numpy(x)).numpy()
    if name == "digamma":
        cpu = np.where(x == 0, np.nan, cpu)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(cpu))
    np.testing.assert_array_equal(np.isposinf(ours), np.isposinf(cpu))
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(cpu))
    finite = np.isfinite(cpu)
    error = np.abs(ours - exact)[finite] / np.maximum(np.abs(exact[finite]), 1.0)
    assert error.max() < 5e-6, (name, x[finite][error.argmax()], error.max())


class _SiLU(torch.nn.Module):
    def forward(self, grad, x):
        return torch.nn.functional.silu(x) + torch.ops.aten.silu_backward(grad, x)


class _GELU(torch.nn.Module):
    # Both forms, forward and backward: the tanh form's two tanhs and erf's derivative's exp.
    def forward(self, grad, x):
        gelu, backward = torch.nn.functional.gelu, torch.ops.aten.gelu_backward
        return (gelu(x) + gelu(x, approximate="tanh") + backward(grad, x)
                + backward(grad, x, approximate="tanh"))


def _tpu_stablehlo(module: torch.nn.Module, dtype) -> str:
    fn, params = to_jax(module)
    spec = jax.ShapeDtypeStruct((4, 8), dtypes.to_jax(dtype))
    return jax.export.export(jax.jit(fn), platforms=["tpu"])(params, spec, spec).mlir_module()


def test_a_half_precision_silu_keeps_the_fast_exp_in_its_float32_math():
    # torch computes a bf16 SiLU in float32 and rounds it: the accurate exp bought nothing there,
    # and fused into a Llama MLP's products it made the TPU compiler retry them (compile1).
    half = _tpu_stablehlo(_SiLU(), torch.bfloat16)
    assert half.count("stablehlo.exponential") == 2 and _accurate_ops(half) == 0
    assert _accurate_ops(_tpu_stablehlo(_SiLU(), torch.float32)) == 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_gelu_keeps_the_fast_forms_in_its_float32_math(dtype):
    # The same rule for GPT-2's MLP (compile2).
    half = _tpu_stablehlo(_GELU(), dtype)
    assert half.count("stablehlo.tanh") == 2 and half.count("stablehlo.exponential") == 1
    assert _accurate_ops(half) == 0
    assert _accurate_ops(_tpu_stablehlo(_GELU(), torch.float32)) == 3


def _forward_and_gradient(fn, dtype):
    x = torch.linspace(-12, 12, 997).to(dtype)
    g = torch.randn(997, generator=torch.Generator().manual_seed(0)).to(dtype)
    ours = x.to("tpu").requires_grad_()
    cpu = x.clone().requires_grad_()
    out, expected = fn(ours), fn(cpu)
    out.backward(g.to("tpu"))
    expected.backward(g)
    torch.testing.assert_close(out.cpu(), expected.detach())
    torch.testing.assert_close(ours.grad.cpu(), cpu.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_and_its_gradient_match_cpu(dtype):
    _forward_and_gradient(torch.nn.functional.silu, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gelu_and_its_gradient_match_cpu(dtype, approximate):
    _forward_and_gradient(lambda v: torch.nn.functional.gelu(v, approximate=approximate), dtype)
