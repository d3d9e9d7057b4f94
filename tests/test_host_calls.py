"""The Python calls (functions and builtins: ``sys.setprofile``'s call and c_call events, a
load-free figure) of one op call on the per-op host paths a training step takes at every op:
DeferAndFuse's replay of a kept call (``eager/defer_replay.py``), Strict's short path for a
remembered signature (``eager/seen_calls.py``, ``calls.run_seen``), launched or held
(``lazy_casts.held_call``), and DeferAndFuse's replay of an optimizer's list call
(``eager/defer_replay_lists.py``). Each bound is what the path takes now (a
list call's: per tensor), below what it took before its steps were inlined (issue 50's host
time: a frame less a call is ~2-5% of these paths)."""

import os
import subprocess
import sys

import pytest
import torch

from torchtpu.eager import defer_replay

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE


@pytest.fixture(autouse=True)
def fresh_tape():
    defer_replay.REPLAY.tape.clear()


def _counted(fn):
    """(fn(), its Python calls on this thread)."""
    n = [0]

    def profile(frame, event, arg):
        if event == "call" or event == "c_call":
            n[0] += 1

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, n[0]


def _operands():
    torch.manual_seed(0)
    return torch.randn(8, 8).to("tpu"), torch.randn(8, 8).to("tpu")


# In a process of its own: how many calls Strict's short path takes depends on what the process
# ran before (the remembered variants of a signature that other tests' calls added, the growing
# hook's answers), and in the suite the same call took 50 (session 41's run).
_STRICT_COUNTS = """
import sys, torch, torchtpu
sys.path.insert(0, sys.argv[1])
from test_host_calls import _counted, _operands
a, b = _operands()
for _ in range(3):  # remembered, its launcher and holder found
    torch.mm(a, b), a * b
launched, n_mm = _counted(lambda: torch.mm(a, b))
held, n_mul = _counted(lambda: a * b)  # held (``lazy_casts.held_call``) until read
torch.testing.assert_close(launched.cpu(), a.cpu() @ b.cpu())
torch.testing.assert_close(held.cpu(), a.cpu() * b.cpu())
print(n_mm, n_mul)
"""


def test_a_strict_call_on_the_short_path_stays_within_its_calls():
    env = {**os.environ, "TORCHTPU_NOTICES": "0"}
    out = subprocess.run([sys.executable, "-c", _STRICT_COUNTS, os.path.dirname(__file__)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    n_mm, n_mul = map(int, out.stdout.split()[-2:])
    assert n_mm <= 34, n_mm  # (35 before: ``bare_storage`` a frame)
    assert n_mul <= 45, n_mul  # (47 before)


def test_a_replayed_deferred_call_stays_within_its_calls():
    a, b = _operands()
    counts, replayed = [], []
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(4):
            before = defer_replay.REPLAY.replayed
            c, n = _counted(lambda: torch.mm(a, b))
            replayed.append(defer_replay.REPLAY.replayed - before)
            counts.append(n)
            torch.testing.assert_close((c * a).cpu(), (a.cpu() @ b.cpu()) * a.cpu())
    assert replayed[1:] == [1, 1, 1], replayed
    assert max(counts[1:]) <= 48, counts  # (60 before)


def test_a_replayed_list_call_stays_within_its_calls_a_tensor():
    torch.manual_seed(0)
    xs, ys, zs = ([torch.randn(4, 4).to("tpu") for _ in range(32)] for _ in range(3))
    counts, replayed = [], []
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(5):  # (kept at its place from the second step on)
            x = [t * 1 for t in xs]
            before = defer_replay.REPLAY.replayed
            _, n = _counted(lambda x=x: torch._foreach_addcmul_(x, ys, zs, 0.5))
            replayed.append(defer_replay.REPLAY.replayed - before)
            counts.append(n)
            torch.testing.assert_close(x[3].cpu(), xs[3].cpu() + 0.5 * ys[3].cpu() * zs[3].cpu())
    assert replayed[2:] == [1, 1, 1], replayed
    # Per tensor of its three lists (96): the checks of its geometry and value, its input's
    # reference, its output's pending value and target (1,090 in all; 1,376 before).
    assert max(counts[2:]) <= 96 * 12, counts
