"""A new shape's zeros: a program compiled once, or the bytes sent from the host each time.

A never-written storage that is read (``torch.empty`` then a view written), ``torch.ones``,
``zeros``, ``full`` and ``zero_``/``fill_`` of a new shape each compile a program on the device
(``device/constants.py::zeros_program``, the factory lowerings); a host transfer of the constant
would compile nothing, but costs its bytes every time. Per shape this prints, side by side:

- ``compile``: the first call of the jitted zeros program (compile and run) on this process's
  device, and ``put``: ``jax.device_put`` of ``np.zeros`` (made on the host, sent, waited on),
  the median of 5; their ratio;
- with ``--tpu v5e:1x1`` (libtpu installed: compile-only, nothing runs), the TPU compiler's
  wall and CPU seconds for the same program, and the bytes a transfer would move.

    python bench/zeros_transfer.py [--tpu v5e:1x1]

On a chip the first two columns are the chip's own figures (the trade-off's real sides).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# (shape, dtype): a norm's weight, the tiny Llama's projections, an 8B model's, its embedding.
SHAPES = [((), np.float32), ((128,), np.float32), ((256, 128), np.float32),
          ((4096,), np.float32), ((4096, 4096), np.float32), ((14336, 4096), jnp.bfloat16),
          ((32768, 1024), np.float32), ((128256, 4096), np.float32)]


def _zeros(shape: tuple, dtype):
    def zeros():
        return jnp.zeros(shape, dtype)

    zeros.__name__ = f"zeros_{'x'.join(map(str, shape)) or 'scalar'}_{np.dtype(dtype).name}"
    return jax.jit(zeros)


def _on_device(shape: tuple, dtype) -> tuple[float, float]:
    start = time.perf_counter()
    _zeros(shape, dtype)().block_until_ready()
    compiled = time.perf_counter() - start
    device = jax.devices()[0]
    puts = []
    for _ in range(5):
        start = time.perf_counter()
        jax.device_put(np.zeros(shape, dtype), device).block_until_ready()
        puts.append(time.perf_counter() - start)
    return compiled, statistics.median(puts)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tpu", default=None, help="a TPU target to compile for (v5e:1x1)")
    p.add_argument("--max-mib", type=float, default=2048,
                   help="skip shapes above this many MiB on the device (host memory)")
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, device {jax.devices()[0].device_kind}", flush=True)
    if args.tpu:
        from torchtpu.targets import tpu_target
        tpu_target.compile_function(_zeros((8,), np.float32), target_name=args.tpu)  # libtpu up
    rows = []
    print(f"{'shape':>16s} {'dtype':>8s} {'MiB':>9s} {'compile ms':>11s} {'put ms':>8s} "
          f"{'compile/put':>11s} {'TPU compile ms (CPU ms)':>24s}", flush=True)
    for shape, dtype in SHAPES:
        mib = int(np.prod(shape)) * np.dtype(dtype).itemsize / 2**20
        row = {"shape": shape, "dtype": np.dtype(dtype).name, "mib": mib}
        if mib <= args.max_mib:
            row["compile_s"], row["put_s"] = _on_device(shape, dtype)
        if args.tpu:
            report = tpu_target.compile_function(_zeros(shape, dtype), target_name=args.tpu)
            row["tpu_compile_s"] = report.compile_seconds
            row["tpu_compile_cpu_s"] = report.compile_cpu_seconds
        rows.append(row)
        on = (f"{row['compile_s'] * 1e3:11.1f} {row['put_s'] * 1e3:8.2f} "
              f"{row['compile_s'] / row['put_s']:11.1f}") if "put_s" in row else \
            f"{'-':>11s} {'-':>8s} {'-':>11s}"
        tpu = (f"{row['tpu_compile_s'] * 1e3:12.1f} ({row['tpu_compile_cpu_s'] * 1e3:.1f})"
               if "tpu_compile_s" in row else "")
        print(f"{str(shape):>16s} {row['dtype']:>8s} {mib:9.3f} {on} {tpu:>24s}", flush=True)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
