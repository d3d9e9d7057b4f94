"""DeferAndFuse's fused programs in a new process (``eager/fused_program.keyed``): loaded by
torchtpu's key from a warm cache, nothing traced, and the key exact: a recording that differs
from one the cache holds in a single fact (a call's op, a static argument, a number the call
takes, which input a call reads, the outputs still alive, the inputs donated, an input's shape)
traces its own program, with CPU's values. A directory others can write loads nothing by key."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

# Each case: a function of (a, b, device) run under DeferAndFuse on tpu and as is on CPU,
# returning the values to compare. argv: the cases to run, in order.
# The collector is off: a value a reference cycle holds stays alive, as it does until the
# collector's next pass, whose timing varies (other threads' allocations), so a cycle left by a
# call's first signature (Dynamo's import, the refusal check's error) gives the first process's
# recording another program than the second's every time, not now and then (CI's barrier case).
_SCRIPT = """
import gc; gc.disable()
import json, sys
from jax import monitoring
fused, traces = [0], [0]
def on(event, seconds, fun_name="", **_):
    if event == "/jax/core/compile/jaxpr_trace_duration":
        traces[0] += 1  # a fused program, or a recorded call's lowering traced for its shapes
        fused[0] += fun_name == "defer_and_fuse"
monitoring.register_event_duration_secs_listener(on)
import torch, torchtpu

def matmul(a, b):
    return [(a @ b.t()).sin()]

def matmul_op(a, b):  # another op at one node
    return [(a @ b.t()).cos()]

def matmul_shared(a, b):  # the product reads one input twice (the same geometry)
    return [(a @ a.t()).sin()]

def reduce(a, b):
    return [(a * b).sum(dim=1)]

def reduce_static(a, b):  # a static argument of one call
    return [(a * b).sum(dim=0)]

def reduce_shape(a, b):  # inputs of another shape
    return [(a[:3] * 1).sum(dim=1) * b[:3].sum(dim=1)]

def scaled(a, b):
    return [a * 2.0 + b]

def scaled_number(a, b):  # a number of one call
    return [a * 3.0 + b]

def dropped(a, b):
    h = a * b
    out = h.exp()
    del h
    return [out.cpu()]

def kept(a, b):  # one more output alive at the flush
    h = a * b
    out = h.exp()
    return [out.cpu(), h]

def donated(a, b):
    c = a + 0
    c.cpu()  # run: c holds an array
    out = c * b
    del c  # nothing but the recording holds c's array: the flush gives its buffer to out
    return [out.cpu()]

def held(a, b):  # c alive: not donated, and still readable after
    c = a + 0
    c.cpu()
    out = c * b
    return [out.cpu(), c]

def wired(a, b):
    return [(a * b) - a]

def wired_other(a, b):  # one call reads another input (of the same shape)
    return [(a * b) - b]

def barrier(a, b):  # one of torchtpu's jax_ops (checkpointing's barrier) in the recording
    a = a * 2
    if a.device.type == "tpu":  # (of values pending, as checkpointed regions' inputs are)
        a, b = torch.tpu.ops.optimization_barrier([a, b * 1])
    return [(a * b).sum(dim=1)]

def train(a, b):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                torch.nn.Linear(16, 1)).to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(3):
        loss = model(a).sub(b[:, :1]).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return [torch.tensor(losses)]

g = torch.Generator().manual_seed(0)
a_cpu, b_cpu = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
out = {}
for name in sys.argv[1:]:
    case = globals()[name]
    a, b = a_cpu.to("tpu"), b_cpu.to("tpu")
    before = fused[0], traces[0], torchtpu.metrics.snapshot().get("programs_loaded_by_key", 0)
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        got = [t.cpu().tolist() for t in case(a, b)]
    by_key = torchtpu.metrics.snapshot().get("programs_loaded_by_key", 0) - before[2]
    want = [t.tolist() for t in case(a_cpu, b_cpu)]
    out[name] = {"traced": fused[0] - before[0], "traces": traces[0] - before[1],
                 "by_key": by_key, "tpu": got, "cpu": want}
print(json.dumps(out))
"""

BASES = ["matmul", "reduce", "scaled", "wired", "dropped", "donated", "barrier", "train"]
# Each recording that differs from a base in one fact, and the base it differs from.
VARIANTS = {"matmul_op": "matmul", "matmul_shared": "matmul", "reduce_static": "reduce",
            "reduce_shape": "reduce", "scaled_number": "scaled", "wired_other": "wired",
            "kept": "dropped", "held": "donated"}


def _run(cache, cases: list) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(cache), "TORCHTPU_CPU_FALLBACK": "error"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, *cases], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _same(result: dict) -> None:
    for name, r in result.items():
        assert len(r["tpu"]) == len(r["cpu"]), name
        for got, want in zip(r["tpu"], r["cpu"], strict=True):
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6,
                                       err_msg=name)


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache one process filled with the bases' fused programs, each traced there."""
    cache = tmp_path_factory.mktemp("defer_warm")
    cold, _ = _run(cache, BASES)
    _same(cold)
    assert all(r["traced"] >= 1 and r["by_key"] == 0 for r in cold.values()), cold
    return cache


@pytest.fixture(scope="module")
def warm(filled):
    """A second process: the bases, then each variant (after its base)."""
    result, _ = _run(filled, BASES + list(VARIANTS))
    _same(result)
    return result


def test_a_new_process_loads_each_fused_program_by_key(warm):
    for name in BASES:
        # nor any recorded call's lowering for its result shapes (the first process's, kept)
        assert warm[name]["traces"] == 0 and warm[name]["by_key"] >= 1, (name, warm[name])


def test_a_recording_differing_in_one_fact_traces_its_own_program(warm):
    """Loading the base's program would compute the base's values, or donate a buffer the
    variant still holds: each variant traces its own, and every value equals CPU's."""
    for variant in VARIANTS:
        assert warm[variant]["traced"] == 1 and warm[variant]["by_key"] == 0, \
            (variant, warm[variant])


def test_a_directory_others_can_write_loads_nothing_by_key(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    _run(shared, ["matmul"])
    again, err = _run(shared, ["matmul"])
    assert "warm starts are off" in err
    assert again["matmul"]["traced"] == 1 and again["matmul"]["by_key"] == 0
    _same(again)
