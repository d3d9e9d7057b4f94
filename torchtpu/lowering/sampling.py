"""Grid sampling (``grid_sampler_2d`` / ``grid_sampler_3d``, forward and backward) with CPU's
coordinate rules: align_corners, zeros / border / reflection padding, bilinear (trilinear in
3-d), nearest (ties to even, as ``nearbyint``) and, in 2-d, bicubic.

One sampler serves both ranks: the grid's last axis holds (x, y[, z]), the input's spatial axes
run (d,) h, w, so the grid's coordinates are read in reverse. Backward lowerings are the
``jax.vjp`` of the forward.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import torch

from torchtpu.lowering.registry import lowers

aten = torch.ops.aten

_NEAREST, _BICUBIC = 1, 2
_BORDER, _REFLECTION = 1, 2


def _reflect(coord, low: float, high: float):
    """Reflect coord into [low, high] (PyTorch's reflect_coordinates, over twice the span)."""
    if high <= low:
        return jnp.zeros_like(coord)
    span = high - low
    dist = jnp.abs(coord - low)
    flips = jnp.floor(dist / span)
    extra = dist - flips * span
    return jnp.where(flips % 2 == 0, extra + low, span - extra + low)


def _unnormalize(coord, size: int, align_corners: bool):
    """Grid coordinate in [-1, 1] -> input pixel coordinate."""
    if align_corners:
        return (coord + 1) / 2 * (size - 1)
    return ((coord + 1) * size - 1) / 2


def _pad_coord(coord, size: int, padding_mode: int, align_corners: bool):
    if padding_mode == _REFLECTION:
        if align_corners:
            coord = _reflect(coord, 0, size - 1)
        else:
            coord = _reflect(coord, -0.5, size - 0.5)
    if padding_mode in (_BORDER, _REFLECTION):  # border, and reflection's final clip
        coord = jnp.clip(coord, 0, size - 1)
    return coord


def _sample(x, positions):
    """x[n, :, *positions] for integer positions (one (N, *out) array per spatial axis), zero
    outside the input: (N, C, *out)."""
    spatial = x.shape[2:]
    inside = True
    flat = 0
    for p, size in zip(positions, spatial, strict=True):
        inside = inside & (p >= 0) & (p < size)
        flat = flat * size + jnp.clip(p, 0, size - 1)
    n, c = x.shape[:2]
    got = jnp.take_along_axis(x.reshape(n, c, math.prod(spatial)), flat.reshape(n, 1, -1), 2)
    return jnp.where(inside[:, None], got.reshape((n, c) + positions[0].shape[1:]), 0)


def _cubic_weights(t):
    a = -0.75
    near = lambda v: ((a + 2) * v - (a + 3)) * v * v + 1  # noqa: E731
    far = lambda v: ((a * v - 5 * a) * v + 8 * a) * v - 4 * a  # noqa: E731
    return far(t + 1), near(t), near(1 - t), far(2 - t)


def _bicubic(x, coords, padding_mode: int, align_corners: bool):
    # Taps at unpadded coordinates, the padding applied to each tap (as CPU's bicubic does).
    (fy, fx), (h, w) = coords, x.shape[-2:]
    y0, x0 = jnp.floor(fy), jnp.floor(fx)
    wy, wx = _cubic_weights(fy - y0), _cubic_weights(fx - x0)
    out = 0
    for i in range(4):
        ty = _pad_coord(y0 - 1 + i, h, padding_mode, align_corners).astype(jnp.int32)
        for j in range(4):
            tx = _pad_coord(x0 - 1 + j, w, padding_mode, align_corners).astype(jnp.int32)
            out = out + _sample(x, (ty, tx)) * (wy[i] * wx[j])[:, None]
    return out


def _grid_sample(x, grid, mode: int, padding_mode: int, align_corners: bool):
    spatial = x.shape[2:]
    # grid[..., 0] is x (the last spatial axis): reversed, coords follow the input's axes.
    raw = [_unnormalize(grid[..., k], size, align_corners)
           for k, size in zip(range(len(spatial) - 1, -1, -1), spatial)]
    if mode == _BICUBIC:
        return _bicubic(x, raw, padding_mode, align_corners)
    coords = [_pad_coord(c, size, padding_mode, align_corners)
              for c, size in zip(raw, spatial, strict=True)]
    if mode == _NEAREST:
        return _sample(x, [jnp.round(c).astype(jnp.int32) for c in coords])
    lows = [jnp.floor(c) for c in coords]
    fracs = [c - lo for c, lo in zip(coords, lows, strict=True)]
    lows = [lo.astype(jnp.int32) for lo in lows]
    out = 0
    for corner in itertools.product((0, 1), repeat=len(spatial)):
        weight = math.prod(f if up else 1 - f for f, up in zip(fracs, corner, strict=True))
        taps = [lo + up for lo, up in zip(lows, corner, strict=True)]
        out = out + _sample(x, taps) * weight[:, None]
    return out


@lowers(aten.grid_sampler_2d.default, aten.grid_sampler_3d.default, promote="result")
def grid_sampler(x, grid, interpolation_mode, padding_mode, align_corners):
    return _grid_sample(x, grid, interpolation_mode, padding_mode, align_corners)


@lowers(aten.grid_sampler_2d_backward.default, aten.grid_sampler_3d_backward.default,
        promote="result")
def grid_sampler_backward(grad, x, grid, interpolation_mode, padding_mode, align_corners,
                          output_mask):
    _, vjp = jax.vjp(lambda a, g: _grid_sample(a, g, interpolation_mode, padding_mode,
                                               align_corners), x, grid)
    gx, ggrid = vjp(grad)
    return gx if output_mask[0] else None, ggrid if output_mask[1] else None
