"""The chip's "model" row on the host, counted: ``torch.compile(model)`` with eager
``clip_grad_norm_`` and AdamW (``bench/on_tpu_llama.py --modes model``), one steady step's Python
calls on the main thread and on autograd's (the compiled backward's), its program executions and
host transfers (``torchtpu.metrics``), and the main thread's CPU. Deterministic but the CPU; run it
in two trees to compare them (bench/results-log.md, model2):

    PYTHONPATH=$PWD python bench/model_host.py [--layers 12] [--steps 3] [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

import torch

import torchtpu
from torchtpu.testing.llama import Llama, LlamaConfig, train_step


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/model_host.py", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args(argv)
    c = LlamaConfig(vocab=512, dim=128, heads=2, hidden=256, layers=a.layers, seq=64)
    torch.manual_seed(0)
    with torch.device("tpu"):
        inner = Llama(c)
    compiled = torch.compile(inner, backend="tpu")
    on, main_thread = [False], threading.get_ident()
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if on[0] and event == "call":
            code = frame.f_code
            where = "main" if threading.get_ident() == main_thread else "autograd"
            calls[(where, code.co_filename.split("site-packages/")[-1], code.co_name)] += 1

    def on_backward(grad):
        # The loss's gradient hook runs on autograd's thread before the compiled backward: the
        # one way to profile a thread PyTorch's engine started.
        sys.setprofile(profile)
        return grad

    class Hooked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = inner

        def forward(self, ids, targets):
            loss = compiled(ids, targets)
            loss.register_hook(on_backward)
            return loss

    step, _ = train_step(Hooked())
    ids = torch.randint(c.vocab, (2, c.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER):
        for _ in range(4):
            step(x, y).item()
        before, cpu = torchtpu.metrics.snapshot(), time.thread_time()
        sys.setprofile(profile)
        on[0] = True
        for _ in range(a.steps):
            loss = step(x, y)
        on[0] = False
        sys.setprofile(None)
        cpu = (time.thread_time() - cpu) / a.steps * 1e3
        loss.item()
        after = torchtpu.metrics.snapshot()
    per = {k: (after[k] - before.get(k, 0)) / a.steps for k in after
           if isinstance(after[k], (int, float)) and after[k] != before.get(k, 0)}
    threads = collections.Counter()
    for (where, _, _), n in calls.items():
        threads[where] += n / a.steps
    out = {"python_calls": dict(threads), "metrics": per,
           "main_cpu_ms_profiled": cpu, "load": os.getloadavg()}
    print(out)
    for (where, path, name), n in calls.most_common(a.top):
        print(f"{n / a.steps:8.1f} {where:8s} {path}:{name}")
    return out


if __name__ == "__main__":
    main()
