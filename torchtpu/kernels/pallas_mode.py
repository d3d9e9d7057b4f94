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
"""

from __future__ import annotations

import contextlib
import os

from torchtpu import errors
from torchtpu.runtime import platform

_MODES = ("auto", "on", "off", "tpu")


def mode() -> str:
    value = os.environ.get("TORCHTPU_PALLAS_INTERPRET", "auto").strip().lower() or "auto"
    if value not in _MODES:
        raise ValueError(errors.message(
            "config", f"TORCHTPU_PALLAS_INTERPRET={value!r} is not one of {', '.join(_MODES)}"))
    return value


def setting(where: str = "this jax_op"):
    """The value JAX's interpret override takes now: None (compile natively), True (HLO
    interpreter) or TPU interpreter parameters. ``where`` names the op in errors."""
    chosen, here = mode(), platform.platform()
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
    if chosen == "on" or (chosen == "auto" and here != "tpu"):
        return True
    return None


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


def lowering_hint(where: str, error: BaseException) -> str | None:
    """What to tell the user when a kernel fails to lower, or None if it is not that."""
    text = str(error)
    if "interpret mode" in text or "Cannot lower pallas_call" in text:
        return (f"{where}: a Pallas kernel failed to lower on platform {platform.platform()!r} "
                f"({text.splitlines()[0]}); Pallas kernels compile only on TPU: leave "
                "TORCHTPU_PALLAS_INTERPRET unset (auto) or set it to 'on' to interpret them here")
    return None
