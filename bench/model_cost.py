"""The chip's "model" row compiled for the v5e, compile-only: ``torch.compile(model)`` with eager
``clip_grad_norm_`` and AdamW (``bench/on_tpu_llama.py --modes model``) in Strict, each program
the step runs also compiled for one v5e chip (``targets/tpu_hook.py``): each new program's
cost-model seconds and bytes, the step it first ran in, and the last step's launches by name
(``step_census``; a program compiled in an earlier step runs again under its name). Deterministic
but for libtpu's own choices; run it in two trees to compare their programs (bench/RESULTS.md,
model3). Needs libtpu (/work/venvs/tpu); ~7-10 min at 2 blocks on a loaded host.

    PYTHONPATH=$PWD python bench/model_cost.py [--layers 2] [--batch 1] [--steps 3]
"""

from __future__ import annotations

import argparse
import json

from torchtpu.targets import tpu_hook


def main(argv: list | None = None) -> list:
    p = argparse.ArgumentParser(prog="bench/model_cost.py", description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    tpu_hook.install("v5e:1x1", on_error="keep")  # before the first program: every one is seen
    import torch

    from torchtpu.testing.llama import Llama, LlamaConfig, train_step
    from torchtpu.testing.step_census import census

    c = LlamaConfig(vocab=32768, dim=1024, heads=8, hidden=2816, layers=a.layers, seq=1024)
    torch.manual_seed(0)
    with torch.device("tpu"):
        model = Llama(c)
    step, _ = train_step(torch.compile(model, backend="tpu"))
    ids = torch.randint(c.vocab, (a.batch, c.seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    rows: list = []
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER):
        for i in range(a.steps):
            done = len(tpu_hook.wait())
            with census(dots=False) as counted:
                loss = step(x, y).item()
            reports = tpu_hook.wait()[done:]
            for r in reports:
                rows.append(dict(step=i, name=r.name, ms=(r.seconds or 0) * 1e3,
                                 gb=r.bytes_accessed / 1e9, compile_s=r.compile_seconds))
                print(f"step {i} {r.name[:60]:60s} {(r.seconds or 0) * 1e3:8.3f} ms "
                      f"{r.bytes_accessed / 1e9:7.3f} GB", flush=True)
            print(f"step {i} loss {loss:.6f} launches {dict(counted.launches)}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
