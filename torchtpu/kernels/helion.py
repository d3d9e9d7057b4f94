"""Helion kernels on tpu tensors: ``helion_op(name, kernel)`` makes a ``jax_op`` of a kernel's
pure-JAX form (``Kernel.jax_fn``, Helion's Pallas backend).

Needs the optional extra ``pip install -e '.[helion]'`` (``helion==1.5.1``) and
``HELION_BACKEND=pallas`` set before the kernel is defined. The op's schema comes from the
kernel's own signature, ``torch.Tensor`` read as ``jax.Array``; the Pallas call Helion generates
is traced under ``jax_op``'s interpret choice, so it runs on XLA:CPU without
``HELION_PALLAS_INTERPRET``, and it lowers into DeferAndFuse and compiled programs like any op.

Why not call the Helion kernel on tpu tensors directly: with ``torch.tpu`` present Helion
assumes Google's TorchTPU and its compiled launcher imports private names from it
(``torch_tpu._internal.pallas.pallas.JaxCallable`` and ``jax_placeholder``, and
``torch_tpu._internal.utils.hardware.get_tpu_device_name``), which torchtpu does not provide;
that fails with ``ModuleNotFoundError: torch_tpu._internal``. With ``HELION_PALLAS_INTERPRET=1``
the direct call does run, through Helion's interpret launcher, but outside the lowering table
(an opaque call, not recorded or compiled with its neighbours). ``jax_fn`` needs none of that.
"""

from __future__ import annotations

import inspect
import typing

import jax
import torch

from torchtpu import errors
from torchtpu.kernels.jax_op import CustomOpDef, jax_op

try:
    import helion as _helion  # noqa: F401
except ImportError as e:
    raise ImportError(errors.message(
        "kernel", "torchtpu.kernels.helion needs Helion: pip install -e '.[helion]' "
        "(helion==1.5.1) and HELION_BACKEND=pallas")) from e


def _as_jax(annotation):
    if annotation is torch.Tensor:
        return jax.Array
    if typing.get_origin(annotation) is tuple:
        return tuple[tuple(_as_jax(a) for a in typing.get_args(annotation))]
    return annotation


def helion_op(name: str, kernel) -> CustomOpDef:
    """The custom op ``name`` running the Helion ``kernel`` (``@helion.kernel``) on tpu tensors."""
    backend = kernel.settings.backend
    if backend != "pallas":
        raise ValueError(errors.message(
            "kernel", f"helion_op {name!r}: the kernel was built for Helion's {backend!r} "
            "backend; set HELION_BACKEND=pallas before defining it (only the Pallas "
            "backend has a pure-JAX form to lower)"))
    hints = typing.get_type_hints(kernel.fn)
    signature = inspect.signature(kernel.fn)

    def run(*args):
        return kernel.jax_fn(*args)

    run.__signature__ = signature.replace(
        parameters=[p.replace(annotation=_as_jax(hints.get(p.name, p.empty)))
                    for p in signature.parameters.values()],
        return_annotation=_as_jax(hints.get("return", inspect.Signature.empty)))
    run.__annotations__ = {
        **{n: _as_jax(a) for n, a in hints.items() if n != "return"},
        **({"return": _as_jax(hints["return"])} if "return" in hints else {})}
    run.__qualname__ = getattr(kernel.fn, "__qualname__", name)
    return jax_op(name, run)


__all__ = ["helion_op"]
