"""Strict's per-op programs in a new process (cache/warm_dispatch.py): loaded by torchtpu's
own key, each op traced and lowered in the first process only, with lazy pointwise ops on (the
default), and so are the device layer's own programs (a view read to the host, a strided write,
a cast into a view: ``warm_dispatch.keyed``) and a mask's count and gather, each loaded ahead of
use on a thread from the list the first process left (``warm_ahead.py``; with
``TORCHTPU_LOAD_AHEAD=0``: loaded when asked); jit's dispatch for every
signature; a directory others can write, or a JAX whose private entry points differ, keeps to
JAX's cache (traced first). The calls' meta results are the first process's too
(``eager/facts.py``)."""

import json
import os
import subprocess
import sys

import pytest

# A small model's forward and backward, an op at two shapes and an in-place op on tpu, each
# result against CPU's; the traces JAX makes and the programs loaded by key around the work.
_SCRIPT = """
import json
from jax import monitoring
traces = [0]
def on(event, seconds, fun_name="", **_):
    if event == "/jax/core/compile/jaxpr_trace_duration":
        traces[0] += 1  # an op's program (named after the op) or the device layer's
monitoring.register_event_duration_secs_listener(on)
import os, types
import torch, torchtpu
from torch import nn
from torchtpu.cache import warm_dispatch
how = os.environ.get("BREAK_DISPATCH")  # JAX's entry point as another version could have it
if how == "missing":
    warm_dispatch._jax = types.SimpleNamespace()
elif how == "signature":
    warm_dispatch._jax = types.SimpleNamespace(pjit=lambda name, fun, cache_miss: None)
elif how == "version":
    warm_dispatch.jax = types.SimpleNamespace(__version__="0.12.0")

def work(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    model = model.to(device)
    x = torch.linspace(-2, 2, 8 * 16).reshape(8, 16).to(device)
    loss = model(x).square().mean()
    loss.backward()
    y = torch.linspace(0, 1, 5).to(device)
    other = (y * 3).exp().add_(x[0, :5]) * (x[:2, :5] * 3)  # mul at a second shape
    listed = torch._foreach_add([y, other], [0.5, 2.0])  # a program taking a list of numbers
    # a program calling XLA:CPU's LAPACK kernels, which a loading process must register first
    inverse = torch.linalg.inv(torch.eye(3, device=device) * 2 + 0.5)
    # the device layer's programs: a view read to the host, a strided write, a cast into a view
    column = x[:, 1:3].cpu()
    z = torch.zeros(8, 16, device=device)
    z[:, ::2] = x[:, ::2]
    z.t()[1].copy_(torch.arange(8, device=device))
    # a mask's programs (its count, then the gather at that count), run outside any op's; the
    # mask a transfer (a held comparison read by them is still applied op by op, traced)
    mask = (x.cpu() > 0.5).to(device)
    picked = x[mask].sum() + torch.nonzero(mask).sum()
    # Strict's lazy casts read alone, on the host (eager/lazy_casts.py): a tensor's cast, and
    # a held product's cast (the product computed and cast by one program)
    cast = x.to(torch.bfloat16).cpu().float().sum()
    cast_of_held = (x * z).to(torch.bfloat16).cpu().float().sum()
    return [loss.item(), model[0].weight.grad.sum().item(), other.sum().item(),
            sum(t.sum().item() for t in listed), inverse.sum().item(), column.sum().item(),
            z.sum().item(), picked.item(), cast.item(), cast_of_held.item()]

cpu = work("cpu")
# the first program starts the thread that loads the last run's programs ahead: let it finish,
# so that the work's loads count as found loaded or not, whatever the box's load
torch.ones(2, device="tpu").sum().item()
from torchtpu.cache import warm, warm_ahead
ahead = warm._ahead_state[0] if warm._ahead_state else None
if ahead is not None:  # (past its window the thread waits for the work: it would not end)
    assert len(ahead._keys) <= warm_ahead.WINDOW, len(ahead._keys)
    ahead.thread.join()
from torchtpu.eager import meta
metas, run_meta = [0], meta._run_meta
def counted(*args):  # PyTorch's meta kernel run for a call signature new to this process
    metas[0] += 1
    return run_meta(*args)
meta._run_meta = counted
names = ("programs_loaded_by_key", "warm_dispatch_off", "programs_loaded_ahead")
before, counts = traces[0], [torchtpu.metrics.snapshot().get(n, 0) for n in names]
tpu = work("tpu")
after = [torchtpu.metrics.snapshot().get(n, 0) for n in names]
meta_runs = metas[0]
try:  # a call CPU refuses for its dtype is refused in every process (no result was kept)
    torch.nn.functional.gelu(torch.ones(3, dtype=torch.long, device="tpu"))
    refused = None
except (RuntimeError, NotImplementedError) as e:
    refused = str(e)
print(json.dumps({"cpu": cpu, "tpu": tpu, "traces": traces[0] - before,
                  "by_key": after[0] - counts[0], "off": after[1] - counts[1],
                  "ahead": after[2] - counts[2], "metas": meta_runs, "refused": refused}))
"""


def _run(cache, broken: str = "", ahead: bool = True) -> tuple[dict, str]:
    # (a run that breaks the dispatch does not load ahead: it would leave the next run a list
    # of its own few programs)
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(cache), "TORCHTPU_CPU_FALLBACK": "error",
           "BREAK_DISPATCH": broken, "TORCHTPU_LOAD_AHEAD": "1" if ahead and not broken else "0"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache one process filled: every op program traced, none loaded by key."""
    cache = tmp_path_factory.mktemp("warm_eager")
    cold, _ = _run(cache)
    assert cold["traces"] > 0 and cold["by_key"] == 0 == cold["off"] == cold["ahead"]
    assert cold["metas"] > 0 and "GeluKernelImpl" in cold["refused"], cold
    assert cold["tpu"] == pytest.approx(cold["cpu"], rel=1e-5, abs=1e-6)
    return cache, cold


def test_second_process_traces_no_op_program(filled):
    cache, _ = filled
    warm_run, _ = _run(cache)
    assert warm_run["traces"] == 0 and warm_run["by_key"] > 0 and warm_run["off"] == 0
    # every program the work asked for was loaded ahead, on the thread (warm_ahead.py): none
    # on the work's own path
    assert warm_run["ahead"] == warm_run["by_key"], warm_run
    # every call signature's meta result was the first process's (eager/facts.py): no meta
    # kernel ran; the refused call, which kept none, is refused again
    assert warm_run["metas"] == 0 and "GeluKernelImpl" in warm_run["refused"], warm_run
    assert warm_run["tpu"] == pytest.approx(warm_run["cpu"], rel=1e-5, abs=1e-6)


def test_without_loading_ahead_each_program_loads_when_asked(filled):
    cache, _ = filled
    run, _ = _run(cache, ahead=False)
    assert run["traces"] == 0 and run["by_key"] > 0 and run["ahead"] == 0
    assert run["tpu"] == pytest.approx(run["cpu"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("broken", ["missing", "signature", "version"])
def test_jax_without_the_entry_point_runs_every_op_by_jit(filled, broken):
    """A JAX whose _jax.pjit is gone, takes other arguments, or is a version not checked:
    Strict's ops run by jax.jit as before (traced again, found in JAX's cache), said once."""
    cache, cold = filled
    run, err = _run(cache, broken)
    assert run["by_key"] == 0 and run["traces"] == cold["traces"] and run["off"] > 0
    assert run["tpu"] == pytest.approx(run["cpu"], rel=1e-5, abs=1e-6)
    assert err.count("eager op programs are not loaded by key") == 1, err


def test_directory_others_can_write_traces_every_op(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    cold, err = _run(shared)
    warm_run, _ = _run(shared)
    assert "warm starts are off" in err
    assert warm_run["by_key"] == 0 and warm_run["traces"] == cold["traces"] > 0


def test_meta_results_read_back_as_inferred():
    """Each form ``meta.describe`` gives (a channels-last or strided layout, an int, None, a
    tuple of them) reads back from the record's JSON equal; a damaged fact reads as none."""
    import torch

    from torchtpu.eager import facts, meta

    x = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    forms = [meta.describe(x), meta.describe(x.permute(0, 2, 1, 3), strides=True),
             meta.describe(torch.empty(3, dtype=torch.bfloat16)), 7, None,
             meta.describe((torch.empty(2, dtype=torch.int64), torch.empty((), dtype=torch.bool)))]
    assert forms[0][2] is torch.channels_last and len(forms[1]) == 3
    for form in forms:
        assert facts._decode_meta(json.loads(json.dumps(facts._encode_meta(form)))) == form
    facts.META._known = {"damaged": {"d": [[2], "not_a_dtype", None]}}
    try:
        assert facts.meta_result("damaged") is facts.MISSING
    finally:
        facts.META._known = None


def test_a_kept_meta_result_is_the_default_dtype_s(monkeypatch):
    """A factory's result dtype follows the default dtype: a result kept under float32 is not
    another process's under float64."""
    import torch

    from torchtpu.cache import warm
    from torchtpu.eager import facts, meta

    kept = facts.Facts("meta results")
    kept._known, kept._exit_pid = {}, os.getpid()  # (nothing read or written at exit)
    monkeypatch.setattr(facts, "META", kept)
    monkeypatch.setattr(warm, "cache_on", lambda: True)
    monkeypatch.setattr(meta, "_meta_cache", {})
    op, values = torch.ops.aten.full.default, [[2], 1.5, None, None, None, None]
    assert meta.infer(op, values)[1] == torch.float32 and kept._new
    meta._meta_cache.clear()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert meta.infer(op, values)[1] == torch.float64
    finally:
        torch.set_default_dtype(previous)


def test_a_kept_meta_result_does_not_skip_cpus_dtype_check(monkeypatch):
    """Another process's record may describe a call CPU refuses (stop 52's suite read one for
    ``mm`` of bools and returned a product): the fact gives the shapes, CPU is still asked."""
    import torch

    from torchtpu.cache import warm
    from torchtpu.eager import facts, meta, refusals

    kept = facts.Facts("meta results")
    kept._exit_pid = os.getpid()  # (nothing written at exit)
    monkeypatch.setattr(facts, "META", kept)
    monkeypatch.setattr(warm, "cache_on", lambda: True)
    monkeypatch.setattr(meta, "_meta_cache", {})
    monkeypatch.setattr(refusals, "_accepted", set())
    a, b = torch.ones(5, 10, dtype=torch.bool), torch.ones(10, 5, dtype=torch.bool)
    values = [a.to("tpu"), b.to("tpu")]
    op = torch.ops.aten.mm.default
    key = (op, meta.call_key(meta.schema.info(op), values), ())
    text = facts.text_of("meta", key, False)
    kept._known = {text: facts._encode_meta(((5, 5), torch.bool))}
    assert facts.meta_result(text) == ((5, 5), torch.bool)
    with pytest.raises(NotImplementedError) as expected:
        torch.mm(a, b)
    with pytest.raises(NotImplementedError) as info:
        torch.mm(*values).cpu()
    assert str(info.value) == str(expected.value)
