"""Whether Pallas kernels run compiled (Mosaic, on TPU) or in interpret mode, chosen per platform.

A ``pl.pallas_call`` lowers natively only on TPU; elsewhere it must be interpreted. Every
``jax_op`` traces its function inside ``interpreting()``, which sets JAX's interpret override for
the ``pallas_call``\\ s traced there, so a kernel written for TPU runs unchanged on XLA:CPU (and
XLA:GPU) without the author passing ``interpret=``.

``TORCHTPU_PALLAS_INTERPRET`` chooses:

- ``auto`` (default): compiled on TPU, interpreted on every other platform;
- ``on``: always interpreted (JAX's HLO interpreter: the grid becomes XLA loops);
- ``off``: never (on CPU a ``pallas_call`` then fails to lower: only for checking that);
- ``tpu``: JAX's TPU-simulating interpreter (VMEM, DMAs and semaphores modelled; slow), which
  runs only on the CPU platform.

A program is traced for a TPU when the platform is TPU or when a TPU target's compile
(``targets/tpu_target.py``) traces it with JAX's default device set to one of its compile-only
TPU devices (``for_tpu()``); its kernels then compile through Mosaic, on any host.

Mosaic takes less than XLA, and torchtpu's JAX settings are XLA's: x64 on (torch's int64 and
float64), where a Python int in a kernel (a loop bound, an index map's ``0``) traces as int64
and a Python float as float64, and matmul precision "highest" (torch's float32), which a Pallas
dot on bfloat16 operands takes as an fp32 contraction. Mosaic's index arithmetic is 32-bit, it
has no float64 and it refuses fp32 contractions of bfloat16, so kernels trace under
``kernel_defaults()`` (32-bit defaults; one-pass precision, exact for bfloat16, when the
operands are narrower than float32). ``mosaic_ready(fn)`` does that for a third party's kernel
function, forward and backward (a ``custom_vjp``'s backward is traced after its call returns).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import jax.numpy as jnp

from torchtpu import errors, settings
from torchtpu.runtime import platform


def mode() -> str:
    return settings.PALLAS_INTERPRET.get()


def setting(where: str = "this jax_op"):
    """The value JAX's interpret override takes now: None (compile natively), True (HLO
    interpreter) or TPU interpreter parameters. ``where`` names the op in errors."""
    chosen, here = mode(), platform.platform()
    if chosen == "auto":
        return None if for_tpu() else True
    if chosen == "tpu":
        if here != "cpu":
            raise RuntimeError(errors.message("kernel",
                f"{where}: TORCHTPU_PALLAS_INTERPRET=tpu asks for JAX's TPU-simulating "
                f"interpreter, which runs only on the CPU platform, but this process runs on "
                f"{here!r}; use "
                "TORCHTPU_PALLAS_INTERPRET=on (HLO interpreter, any platform) or auto, or run "
                "with TORCHTPU_PLATFORM=cpu"))
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    return True if chosen == "on" else None


def for_tpu() -> bool:
    """Whether the program being traced now is for a TPU (the platform's, or a target's)."""
    if platform.platform() == "tpu":
        return True
    device = jax.config.jax_default_device
    return (device if isinstance(device, str) else getattr(device, "platform", "")) == "tpu"


@contextlib.contextmanager
def interpreting(where: str = "this jax_op"):
    """Trace ``pallas_call``\\ s under the platform's interpret setting (see the module doc)."""
    value = setting(where)
    if value is None:
        yield
        return
    from jax.experimental.pallas import tpu as pltpu

    # Any truthy value is taken as pallas_call's interpret argument (True: the HLO interpreter).
    with pltpu.force_tpu_interpret_mode(value):
        yield


@contextlib.contextmanager
def kernel_defaults(dtype=None):
    """Trace the ``pallas_call``\\ s made here as Mosaic takes them (see the module doc), for
    operands of ``dtype`` (None: float32 or wider); the operands keep their dtypes."""
    narrow = dtype is not None and jnp.issubdtype(dtype, jnp.floating) \
        and jnp.dtype(dtype).itemsize < 4
    precision = "default" if narrow else jax.config.jax_default_matmul_precision
    with jax.enable_x64(False), jax.default_matmul_precision(precision):
        yield


def mosaic_ready(fn: Callable, dtype=None) -> Callable:
    """``fn`` (arrays in, arrays out) traced under ``kernel_defaults(dtype)`` forward and
    backward, its integer arguments as int32 (TPU's index width)."""

    def narrowed(args):
        return [a.astype(jnp.int32) if jnp.issubdtype(a.dtype, jnp.integer) else a
                for a in args]

    @jax.custom_vjp
    def run(*args):
        with kernel_defaults(dtype):
            return fn(*narrowed(args))

    def forward(*args):
        with kernel_defaults(dtype):
            out, pullback = jax.vjp(fn, *narrowed(args))
        return out, pullback

    def backward(pullback, cotangent):
        # Integer arguments get float0 zeros of their shape, as the wrapper's own would.
        with kernel_defaults(dtype):
            return tuple(pullback(cotangent))

    run.defvjp(forward, backward)
    return run


def lowering_hint(where: str, error: BaseException) -> str | None:
    """What to tell the user when a kernel fails to lower, or None if it is not that."""
    text = str(error)
    if "interpret mode" in text or "Cannot lower pallas_call" in text:
        return (f"{where}: a Pallas kernel failed to lower on platform {platform.platform()!r} "
                f"({text.splitlines()[0]}); Pallas kernels compile only on TPU: leave "
                "TORCHTPU_PALLAS_INTERPRET unset (auto) or set it to 'on' to interpret them here")
    return None
