"""torchtpu's JAX settings, made once at import, before anything lowers a program: PyTorch's
64-bit types and float32 matmul precision, the TPU's accurate transcendentals and 64-bit rules,
the XLA compiler options, libtpu's per-process chips, and JAX's TPU client left out where no TPU
is attached.

Imported by ``platform`` (the device) and by the TPU targets (``targets/tpu_target.py``, which
compile without the device): a program lowered for either is lowered under the same settings.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax._src import xla_bridge

from torchtpu import settings
from torchtpu.runtime import chips, compiler_options, environment, tpu_accuracy, tpu_x64


def _skip_absent_tpu() -> None:
    """libtpu installed, no TPU here: keep JAX from starting its TPU client.

    JAX tries every backend it knows at its first device query; with libtpu installed that
    includes a TPU client, which on a machine without a TPU prints warnings and waits (38 s
    measured at load ~8) before JAX falls back to CPU. So when nothing asks for a TPU (no
    ``JAX_PLATFORMS``, no ``TORCHTPU_PLATFORM=tpu``) and none is attached (checked from the
    device files and PCI ids, without libtpu), JAX's TPU backend is left out; compile-only TPU
    targets (``targets/tpu_target.py``) do not need it: they start libtpu with compile-only
    settings.
    """
    try:
        wanted = settings.PLATFORM.get() or ""
    except ValueError:  # it fails at the first device use (platform()), not at import
        wanted = ""
    asked = os.environ.get("JAX_PLATFORMS") or wanted
    if ("tpu" in asked.lower() or "tpu" not in xla_bridge._backend_factories
            or xla_bridge.backends_are_initialized()):
        return
    if environment.tpu_attached():
        return
    # Replaced, not removed: "tpu" must stay a platform JAX knows (Pallas, checkify and Tokamax
    # register TPU lowerings when imported); only its client must not start.

    def absent():
        raise RuntimeError("torchtpu.device: no TPU is attached (torchtpu leaves JAX's TPU client "
                           "out)")

    registration = xla_bridge._backend_factories["tpu"]
    xla_bridge._backend_factories["tpu"] = dataclasses.replace(
        registration, factory=absent, fail_quietly=True)


def _configure_jax() -> None:
    chips.bind_from_environment()  # before anything can start JAX's TPU client
    _skip_absent_tpu()
    # PyTorch semantics need real int64/float64; JAX's default truncates them to 32 bits.
    jax.config.update("jax_enable_x64", True)
    # PyTorch's float32 matmuls are exact float32 by default ("highest");
    # torch.tpu.precision and torch.set_float32_matmul_precision change it.
    jax.config.update("jax_default_matmul_precision", "highest")
    tpu_accuracy.install()
    tpu_x64.install()
    compiler_options.install()


_configure_jax()
