"""Float32 transcendentals lowered for a TPU ask for XLA's accurate forms under HIGHEST precision
(``runtime/tpu_accuracy.py``), and only then; the CPU lowering is JAX's own. The programs are
lowered for the TPU platform with ``jax.export`` (no TPU or libtpu needed): what is checked is the
StableHLO a TPU would compile."""

import jax
import jax.numpy as jnp
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
