"""Discrete Fourier transforms: ``_fft_r2c``, ``_fft_c2c`` and ``_fft_c2r``, which every
``torch.fft`` function (and ``stft``/``istft``) reaches, forward and backward.

ATen's ``normalization`` argument is the scale applied to the result whatever the direction:
0 none, 1 ``1/sqrt(n)``, 2 ``1/n`` (n the product of the transformed sizes). JAX's ``norm``
names the scale relative to the direction instead, so each direction maps the three codes to its
own ``norm`` strings.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchtpu.lowering.registry import lowers

aten = torch.ops.aten

# Normalization code -> jnp.fft `norm` giving that scale on a forward (resp. inverse) transform.
_FORWARD_NORM = ("backward", "ortho", "forward")
_INVERSE_NORM = ("forward", "ortho", "backward")


@lowers(aten._fft_r2c.default)
def fft_r2c(x, dim, normalization, onesided):
    dim = tuple(dim)
    norm = _FORWARD_NORM[normalization]
    if onesided:
        return jnp.fft.rfftn(x, axes=dim, norm=norm)
    return jnp.fft.fftn(x, axes=dim, norm=norm)


@lowers(aten._fft_c2c.default)
def fft_c2c(x, dim, normalization, forward):
    if forward:
        return jnp.fft.fftn(x, axes=tuple(dim), norm=_FORWARD_NORM[normalization])
    return jnp.fft.ifftn(x, axes=tuple(dim), norm=_INVERSE_NORM[normalization])


@lowers(aten._fft_c2r.default)
def fft_c2r(x, dim, normalization, last_dim_size):
    # The last transformed axis holds the onesided half; its full length is last_dim_size.
    sizes = [x.shape[d] for d in dim[:-1]] + [last_dim_size]
    return jnp.fft.irfftn(x, s=sizes, axes=tuple(dim), norm=_INVERSE_NORM[normalization])
