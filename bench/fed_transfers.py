"""A served step's host-fed inputs, one transfer each or packed into one: the launch's cost.

vLLM-TorchTPU's step program reads ~200 storages (weights, KV caches) and nine host buffers
(token ids, positions, query starts, sequence lengths, block table, slot mapping, padding mask,
sampled rows, last-token rows). This builds a program of that shape (``--weights`` storages, the
buffers at vLLM's sizes for ``--max-tokens``, ``--max-reqs``, ``--blocks``) and replays it two
ways in interleaved rounds in one process: ``one_by_one``, each buffer whole as an argument of
its own (before packing), and ``packed``, the rows a step of ``--tokens`` x ``--reqs`` reads
of each, packed into one int32 argument (``HostFeeds`` now). Per replay: the launch's wall and
main-thread CPU time (arguments, the call, the storages' rebinding), the wall to the outputs'
readiness, and the host bytes transferred.

    python bench/fed_transfers.py [--weights 200] [--tokens 1] [--reqs 1] [--rounds 7]
        [--replays 50] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

import torchtpu  # noqa: F401  (device "tpu")
from torchtpu.device.hooks import HOOKS
from torchtpu.eager.capture import storage_of
from torchtpu.integrations.vllm.graphs import HostFeeds, StepGraphs


class _OneByOne(HostFeeds):
    """The feeds as they were before packing: each buffer whole, a transfer of its own."""

    def install(self) -> None:
        for device, host, _ in self._pairs:
            st = storage_of(device)
            shape, dtype = tuple(st._tpu_array.shape), np.dtype(st._tpu_array.dtype)
            HOOKS.capture.feed(st, lambda host=host, s=shape, d=dtype:
                               np.array(host(), d).reshape(s))


def _buffers(a) -> list[tuple[torch.Tensor, np.ndarray, str]]:
    """vLLM's fed buffers (device tensor, host array, the step dimension of its rows)."""
    t, r = a.max_tokens, a.max_reqs
    specs = [("input_ids", (t,), np.int32, "tokens"), ("positions", (t,), np.int64, "tokens"),
             ("query_start_loc", (r + 1,), np.int32, "starts"), ("seq_lens", (r,), np.int32,
                                                                    "reqs"),
             ("block_table", (r, a.blocks), np.int32, "reqs"),
             ("slot_mapping", (t,), np.int64, "tokens"), ("is_padding", (t,), np.bool_, "tokens"),
             ("sample_rows", (r,), np.int64, "reqs"), ("prev_index", (t,), np.int64, "tokens")]
    rng = np.random.default_rng(0)
    out = []
    for _, shape, dtype, dim in specs:
        host = rng.integers(0, 7, size=shape).astype(dtype)
        out.append((torch.zeros(shape, dtype=torch.from_numpy(host).dtype, device="tpu"), host,
                    dim))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", type=int, default=200)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--max-reqs", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=36)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--reqs", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    weights = [torch.randn(a.width, a.width, device="tpu") for _ in range(a.weights)]
    buffers = _buffers(a)
    rows = {"tokens": lambda t, r: t, "reqs": lambda t, r: r, "starts": lambda t, r: r + 1}
    tk, rq = a.tokens, a.reqs

    def step():  # reads each buffer's first rows, as a step's program does, and every weight
        x = torch.zeros(tk, a.width, device="tpu")
        for w in weights:
            x = x + w[:tk] * 1e-3
        ints = sum(b[:(rq + 1 if d == "starts" else rq if d == "reqs" else tk)].sum()
                   for b, _, d in buffers)
        return x.sum() + ints

    graphs = {}
    for name, kind in (("one_by_one", _OneByOne), ("packed", HostFeeds)):
        feeds = kind()
        for device, host, dim in buffers:
            feeds.add(device, lambda host=host: host, rows[dim])
        g = StepGraphs()
        g(name, step, feeds.step(tk, rq))
        graph, output = g._graphs[name]
        fed = [x for x in graph.captured._io.arguments() if isinstance(x, np.ndarray)]
        graphs[name] = (graph, output, sum(x.nbytes for x in fed), len(fed))
    samples = {n: {"launch_wall": [], "launch_cpu": [], "ready_wall": []} for n in graphs}
    for r in range(a.rounds):
        for name in (list(graphs) if r % 2 == 0 else list(reversed(graphs))):
            graph, output, _, _ = graphs[name]
            lw = lc = rw = 0.0
            for _ in range(a.replays):
                w0, c0 = time.perf_counter(), time.thread_time()
                graph.replay()
                w1, c1 = time.perf_counter(), time.thread_time()
                output.cpu()
                lw, lc, rw = lw + w1 - w0, lc + c1 - c0, rw + time.perf_counter() - w0
            for k, v in (("launch_wall", lw), ("launch_cpu", lc), ("ready_wall", rw)):
                samples[name][k].append(1e6 * v / a.replays)
    result = {"weights": a.weights, "tokens": tk, "reqs": rq, "rounds": a.rounds,
              "replays": a.replays, "load": os.getloadavg(), "device": str(torch.tpu.
                                                                        get_device_name(0))}
    for name, (_, _, nbytes, n) in graphs.items():
        result[name] = {"fed_arguments": n, "fed_bytes": nbytes,
                        **{f"{k}_us": statistics.median(v) for k, v in samples[name].items()}}
    text = json.dumps(result, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return result


if __name__ == "__main__":
    main()
