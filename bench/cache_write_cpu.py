"""The persistent cache's write as the compiling thread pays it: CPU seconds per compile.

JAX writes a new executable's cache entry on the thread that compiled it; torchtpu keeps only
the serialization there and writes the rest (compress, read back, file) on a writer thread
(``cache/cache_writer.py``). This compiles the chip row's JAX twin (``bench/tpu_llama.py``'s
step, naive attention) through JAX with an empty cache, and times the calling thread's CPU
(``time.thread_time``) around the compile, beside the process's CPU and the cache write's seconds
on each side (``cache_write_seconds``: the compiling thread's; ``cache_writer_seconds``: the
writer's, after ``compile_cache.flush()``) and the entry's bytes.

    python bench/cache_write_cpu.py [--target here|v5e:1x1] [--layers 2] [--length 1024]
        [--trees BASE AFTER --rounds 3] [--parts]

``--target here`` (the default) compiles for this process's device: XLA:CPU here, the chip on a
TPU machine (``TORCHTPU_PLATFORM=tpu``), where ``--parts`` times the read-back too.

``--target v5e:1x1`` (the TPU venv, libtpu) compiles for a compile-only v5e chip: its executable
serializes and compresses as a chip's would, but cannot be read back here (no chip), so it is
not cached and the read-back's cost is not in the figures. ``--trees`` runs itself with each
tree first on ``PYTHONPATH``, alternating, each run with a fresh cache directory, and prints
every run and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_FIELDS = ("thread_cpu_s", "process_cpu_s", "wall_s", "cache_write_s", "cache_writer_s",
           "entry_bytes")


def _timed(fn, repeat: int = 3) -> tuple:
    """(fn's result, median process CPU s, median wall s) over repeat calls."""
    cpu, wall = [], []
    for _ in range(repeat):
        c, w = time.process_time(), time.perf_counter()
        out = fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return out, statistics.median(cpu), statistics.median(wall)


def _parts(lowered, compiled) -> dict:
    """Each part of a cache write of the compiled program, timed alone (process CPU and wall,
    medians of 3): what the compiling thread did before the writer thread, and does now."""
    import jax
    from jax._src import compilation_cache as jax_cache

    exe = compiled._executable.xla_executable
    data, ser_cpu, ser_wall = _timed(exe.serialize)
    packed, zip_cpu, zip_wall = _timed(lambda: jax_cache.compress_executable(
        jax_cache.combine_executable_and_time(data, 1)))
    found = {"serialized_bytes": len(data), "entry_payload_bytes": len(packed),
             "serialize_cpu_s": ser_cpu, "serialize_wall_s": ser_wall,
             "compress_cpu_s": zip_cpu, "compress_wall_s": zip_wall}
    try:
        devices = exe.local_devices()
    except Exception:  # noqa: BLE001 (a compile-only TPU's: nothing to read back onto)
        return found
    client = jax.devices()[0].client
    _, back_cpu, back_wall = _timed(lambda: client.deserialize_executable(data, devices))
    return {**found, "read_back_cpu_s": back_cpu, "read_back_wall_s": back_wall}


def one(target: str, layers: int, length: int, vocab: int, split: bool = False) -> dict:
    """Compile the twin once here (this process's tree) and measure it."""
    import jax
    import jax.numpy as jnp
    import torch

    import torchtpu
    from torchtpu.cache import compile_cache

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax_models
    import tpu_llama

    torch.ones(1, device="tpu").cpu()  # the platform and the cache started
    c = tpu_llama.config(layers=layers, seq=length, vocab=vocab)
    fn = jax.jit(jax_models.train_step(tpu_llama.loss_fn(c, tpu_llama.naive_attention), 3e-4,
                                       (0.9, 0.999), 1e-8, 0.1, 1.0), donate_argnums=(0, 1, 2))
    if target == "here":
        device = jax.devices()[0]
    else:
        from torchtpu.targets import tpu_target

        device = tpu_target.target(target).devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    params = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
        jax.eval_shape(lambda: tpu_llama.init(c, jax.random.key(0))))
    ids = jax.ShapeDtypeStruct((8192 // length, length), jnp.int32, sharding=sharding)
    lr = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding)
    with jax.enable_x64(False), jax.default_matmul_precision("default"), \
            jax.default_device(device):
        lowered = fn.lower(params, params, params, lr, ids, ids)
    at = torchtpu.metrics.snapshot()
    entries = set(os.listdir(compile_cache.store().path))
    wall, thread, process = time.perf_counter(), time.thread_time(), time.process_time()
    compiled = lowered.compile()
    thread, process = time.thread_time() - thread, time.process_time() - process
    wall = time.perf_counter() - wall
    getattr(compile_cache, "flush", lambda: True)()  # (a tree before the writer: none)
    end = torchtpu.metrics.snapshot()
    path = compile_cache.store().path
    new = [p for p in os.listdir(path) if p not in entries and p.startswith("jit_")]
    parts = _parts(lowered, compiled) if split else {}
    return {**parts, "thread_cpu_s": thread, "process_cpu_s": process, "wall_s": wall,
            "cache_write_s": end.get("cache_write_seconds", 0) - at.get("cache_write_seconds", 0),
            "cache_writer_s": end.get("cache_writer_seconds", 0)
            - at.get("cache_writer_seconds", 0),
            "entry_bytes": sum(os.path.getsize(os.path.join(path, p)) for p in new)}


def _run(tree: str, args) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "PYTHONPATH": tree, "TORCHTPU_CACHE_DIR": cache,
               "TORCHTPU_NOTICES": "0"}
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--target", args.target,
                              "--layers", str(args.layers), "--length", str(args.length),
                              "--vocab", str(args.vocab), "--json"], env=env,
                             capture_output=True, text=True, timeout=3000)
    if out.returncode:
        raise SystemExit(f"{tree}: rc {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="here")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--trees", nargs="+", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true", help="one run here, its figures as JSON")
    p.add_argument("--parts", action="store_true",
                   help="one run here, and each part of the write timed alone")
    args = p.parse_args()
    if args.json or not args.trees:
        found = one(args.target, args.layers, args.length, args.vocab, args.parts)
        print(json.dumps(found) if args.json else found)
        return
    runs: dict = {t: [] for t in args.trees}
    for r in range(args.rounds):
        for tree in args.trees:
            load = open("/proc/loadavg").read().split()[0]
            found = _run(tree, args)
            runs[tree].append(found)
            print(f"round {r + 1} {tree} load {load}: "
                  + " ".join(f"{k} {found[k]:.3f}" for k in _FIELDS), flush=True)
    for tree, found in runs.items():
        print(f"median {tree}: " + " ".join(
            f"{k} {statistics.median(f[k] for f in found):.3f}" for k in _FIELDS))


if __name__ == "__main__":
    main()
