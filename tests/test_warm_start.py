"""Warm starts (cache/warm.py): a new process loads captured programs by torchtpu's own key,
compiling and lowering nothing; a directory others can write gets no warm-start records.
Dynamo's graphs (compile/graph_cache.py): found in PyTorch's caches in the private directory."""

import functools
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache as jax_cache

from torchtpu import metrics
from torchtpu.cache import compile_cache, warm, warm_keys
from torchtpu.cache.compile_cache import CompileCacheWarning, EntryStore


def _child(kind: str) -> None:
    """One process: a training step run three times ("graph": captured with TPUGraph, a
    hand-written SGD update, replayed; "whole": compiled whole with torch.compile and the
    default AdamW), and the same training in CPU eager; losses and counters as JSON."""
    import torch
    from torch import nn

    import torchtpu

    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 6, generator=gen), torch.randn(5, 3, generator=gen))
               for _ in range(3)]

    def build(device):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)

    def sgd_step(model, x, y):
        loss = (model(x) - y).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(0.1 * p.grad)
                p.grad = None
        return loss

    if kind == "precompile":
        _precompile_child(build, batches)
        return
    if kind == "graph":
        # No torch.optim here: its first use imports Dynamo (seconds), kept out of the
        # default suite.
        model = build("cpu")
        cpu = [sgd_step(model, x, y).item() for x, y in batches]
        model = build("tpu")
        static_x, static_y = (t.to("tpu") for t in batches[0])
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g):
            static_loss = sgd_step(model, static_x, static_y)
        tpu = []
        for x, y in batches:
            static_x.copy_(x)
            static_y.copy_(y)
            g.replay()
            tpu.append(static_loss.item())
    else:  # "whole" (one captured program) or "dynamo" (Dynamo's graphs, AOTAutogradCache)
        def adamw_step(model, opt, x, y):
            loss = (model(x) - y).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss

        model = build("cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        cpu = [adamw_step(model, opt, x, y).item() for x, y in batches]
        model = build("tpu")
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        compiled = torch.compile(adamw_step, backend="tpu",
                                 options={"whole_step": kind == "whole"})
        before = _counts()
        tpu = [compiled(model, opt, x.to("tpu"), y.to("tpu")).item() for x, y in batches]
    m = torchtpu.metrics.snapshot()
    print(json.dumps({"cpu": cpu, "tpu": tpu, "compiles": m["executable_compiles"],
                      "hits": m["persistent_cache_hits"],
                      "by_key": m.get("programs_loaded_by_key", 0),
                      **(_since(before) if kind == "dynamo" else {})}))


def _counts() -> dict:
    """What Dynamo, AOTAutograd and torchtpu have traced or loaded so far in this process."""
    from torch._dynamo.utils import counters

    return {"dynamo_graphs": counters["stats"]["unique_graphs"],
            "aot_traced": counters["aot_autograd"]["total"] - counters["aot_autograd"][
                "autograd_cache_hit"],
            "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
            "precompiled": counters["dynamo_cache"]["dynamo_cache_hit"],
            "loaded": metrics.snapshot().get("graphs_loaded_from_torch_cache", 0)}


def _since(before: dict) -> dict:
    return {k: v - before[k] for k, v in _counts().items()}


def _precompile_child(build, batches) -> None:
    """A model's loss compiled with PyTorch's precompile on (graph_cache.py): its forward and
    backward graphs, losses and gradients against CPU eager; what was traced or loaded."""
    import torch

    torch._dynamo.config.caching_precompile = True

    def loss_of(model, x, y):
        return (model(x) - y).square().mean()

    def run(model, fn, device):
        losses, grads = [], []
        for x, y in batches:
            loss = fn(model, x.to(device), y.to(device))
            loss.backward()
            losses.append(loss.item())
            grads.append(torch.cat([p.grad.cpu().flatten() for p in model.parameters()]).tolist())
            model.zero_grad()
        return losses, grads

    cpu = run(build("cpu"), loss_of, "cpu")
    before = _counts()
    compiled = torch.compile(loss_of, backend="tpu")  # where Dynamo installs what it kept
    tpu = run(build("tpu"), compiled, "tpu")
    delta = _since(before)
    torch.compiler.save_cache_artifacts()
    print(json.dumps({"cpu": cpu, "tpu": tpu, **delta}))


def _run(cache, kind: str, **extra: str) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(cache), "TORCHTPU_CPU_FALLBACK": "error",
           **extra}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # this process's (graph_cache.place): the child's own
    out = subprocess.run([sys.executable, __file__, kind], env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["graph", pytest.param("whole", marks=pytest.mark.full)])
def test_second_process_compiles_and_lowers_nothing(tmp_path, kind):
    cache = tmp_path / "cache"
    cold, warm_run = _run(cache, kind), _run(cache, kind)
    assert cold["compiles"] > 0 and cold["by_key"] == 0
    # Nothing of the warm run is compiled. Every captured program (the graph; the whole step)
    # is loaded by key, not traced and lowered to be found in JAX's cache. The whole step's
    # optimizer makes its state eagerly before its first capture (compile/device_steps.py):
    # those are Strict ops, found in JAX's cache as every eager op is; each cold program is
    # found warm one way or the other.
    assert warm_run["compiles"] == 0
    if kind == "graph":
        assert warm_run["hits"] == 0 and warm_run["by_key"] >= 1
    else:
        assert warm_run["by_key"] >= 1
        assert warm_run["by_key"] + warm_run["hits"] == cold["compiles"]
    assert warm_run["tpu"] == cold["tpu"]
    np.testing.assert_allclose(warm_run["tpu"], warm_run["cpu"], rtol=1e-5, atol=1e-6)


def test_processes_on_two_devices_of_a_host_keep_their_own_programs(tmp_path):
    """Two processes of one host sharing a cache, each driving another of its devices (Ray
    Serve's replicas): each runs its own device's programs. The key named the host's first
    device for both, so the second process loaded the first's executable, compiled for device 1,
    and its step failed ("compiled for input shardings that disagree")."""
    cache = tmp_path / "cache"
    host = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    one = _run(cache, "graph", TORCHTPU_LOCAL_DEVICE="1", **host)
    zero = _run(cache, "graph", TORCHTPU_LOCAL_DEVICE="0", **host)
    again = _run(cache, "graph", TORCHTPU_LOCAL_DEVICE="1", **host)
    assert one["compiles"] > 0 and zero["compiles"] > 0 and zero["by_key"] == 0
    assert again["compiles"] == 0 and again["by_key"] >= 1
    assert one["tpu"] == zero["tpu"] == again["tpu"]


@pytest.mark.full  # two processes that import Dynamo and compile: ~17 s of CPU
def test_second_process_runs_dynamo_graphs_untraced(tmp_path):
    """PyTorch's precompile (Dynamo's bytecode and guards) with AOTAutogradCache's bundled
    entries of tpu graphs: the second process traces nothing and loads both graphs."""
    cache = tmp_path / "cache"
    cold, warm_run = _run(cache, "precompile"), _run(cache, "precompile")
    assert cold["dynamo_graphs"] >= 1 and cold["aot_traced"] >= 1 and cold["loaded"] == 0
    assert warm_run["precompiled"] == 1
    assert warm_run["dynamo_graphs"] == 0 and warm_run["aot_traced"] == 0
    assert warm_run["aot_hits"] == 0  # not even looked up: Dynamo installed its backends
    assert warm_run["loaded"] == 2  # the forward and the backward graph
    for run in (cold, warm_run):
        np.testing.assert_allclose(run["tpu"][0], run["cpu"][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(run["tpu"][1], run["cpu"][1], rtol=1e-5, atol=1e-6)


@pytest.mark.full
def test_second_process_loads_dynamo_graphs_of_a_training_step(tmp_path):
    """Without precompile, a step that calls an optimizer: Dynamo traces again, AOTAutograd
    does not (every graph is found in AOTAutogradCache); results as on CPU."""
    cache = tmp_path / "cache"
    cold, warm_run = _run(cache, "dynamo"), _run(cache, "dynamo")
    assert cold["aot_traced"] >= 2 and cold["aot_hits"] == 0 and cold["loaded"] == 0
    assert warm_run["aot_traced"] == 0 and warm_run["aot_hits"] == cold["aot_traced"]
    assert warm_run["loaded"] >= 2
    assert warm_run["compiles"] == 0  # every XLA program from the persistent cache
    np.testing.assert_allclose(warm_run["tpu"], warm_run["cpu"], rtol=1e-5, atol=1e-6)


def test_output_code_round_trip():
    """A tpu graph as AOTAutogradCache keeps it: pickled without its program, rebuilt after
    loading and run as on CPU; refused under other options; never saved with a callback."""
    import copy
    import pickle

    import torch
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchtpu.compile import backend, graph_cache, options

    x = torch.randn(130, 3)  # more rows than a bucket
    gm = make_fx(lambda t: (t.sin() * 2 + t.sum(0),), tracing_mode="fake")(x.to("tpu"))
    opts = options.parse(None, None)
    disk = copy.copy(graph_cache.TpuOutputCode(backend._graph_compiler, gm, "inference", opts))
    disk.prepare_for_serialization()
    saved = pickle.dumps(disk)
    loaded = pickle.loads(saved)
    assert loaded.compiled is None
    before = metrics.snapshot().get("graphs_loaded_from_torch_cache", 0)
    with graph_cache.compiling(opts):
        loaded.post_compile([], None, {})
    assert metrics.snapshot()["graphs_loaded_from_torch_cache"] == before + 1
    (out,) = loaded([x.to("tpu")])
    np.testing.assert_allclose(out.cpu(), x.sin() * 2 + x.sum(0), rtol=1e-6, atol=1e-6)
    with graph_cache.compiling(options.parse(None, {"bucket_size": 64})), \
            pytest.raises(BypassAOTAutogradCache, match="other options"):
        pickle.loads(saved).post_compile([], None, {})
    traced = graph_cache.TpuOutputCode(backend._graph_compiler, gm, "inference",
                                       options.parse(None, {"debug_callback": print}))
    with pytest.raises(BypassAOTAutogradCache, match="debug_callback"):
        copy.copy(traced).prepare_for_serialization()


def test_a_graph_with_a_tpu_constant_is_kept_as_aotautogradcache_saves_it():
    """A tensor made inside the compiled code (Hugging Face's models make several) is a constant
    of the graph; AOTAutogradCache pickles the graph under its FakeTensorMode, where the
    constant's bytes must still be read (it logged "unable to serialize" and kept nothing)."""
    import copy
    import pickle

    import torch
    from torch._subclasses import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchtpu.compile import backend, graph_cache, options

    constant = torch.tensor([1.0, 2.0, 3.0], device="tpu")
    x = torch.randn(4, 3)
    gm = make_fx(lambda t: (t * constant,), tracing_mode="real")(x.to("tpu"))
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    opts = options.parse(None, None)
    disk = copy.copy(graph_cache.TpuOutputCode(backend._graph_compiler, gm, "inference", opts))
    with FakeTensorMode():
        disk.prepare_for_serialization()
    loaded = pickle.loads(pickle.dumps(disk))
    with graph_cache.compiling(opts):
        loaded.post_compile([], None, {})
    (out,) = loaded([x.to("tpu")])
    np.testing.assert_allclose(out.cpu(), x * constant.cpu(), rtol=1e-6, atol=1e-6)


def test_torch_without_the_hooks_caches_nothing(monkeypatch):
    from torchtpu.compile import graph_cache

    monkeypatch.setattr(graph_cache, "_MISSING", "torch._functorch.config.some_setting")
    with pytest.warns(CompileCacheWarning, match="lacks torch._functorch.config.some_setting"):
        assert not graph_cache.usable()


@pytest.fixture
def store_at(monkeypatch):
    """Point the process's persistent cache (JAX's entries and the warm-start records) at an
    EntryStore in a given directory, for the length of a test."""

    def use(path):
        store = EntryStore(path)
        monkeypatch.setattr(compile_cache, "store", lambda: store)
        monkeypatch.setattr(jax_cache, "_cache", store)
        monkeypatch.setattr(jax_cache, "_cache_checked", True)
        monkeypatch.setattr(jax_cache, "_cache_used", True)
        monkeypatch.setattr(warm, "_refused", set())
        return store

    return use


def _double(x):
    return x * 2


def test_program_round_trip_and_damaged_entry(tmp_path, store_at):
    store_at(tmp_path)
    key = warm_keys.key_of("test", "double")
    x = jnp.arange(4.0)
    first = warm.Program(jax.jit(_double), key)
    np.testing.assert_array_equal(first(x), [0, 2, 4, 6])
    before = metrics.snapshot().get("programs_loaded_by_key", 0)
    again = warm.Program(jax.jit(_double), key)  # as a new process would build it
    np.testing.assert_array_equal(again(x), [0, 2, 4, 6])
    assert metrics.snapshot()["programs_loaded_by_key"] == before + 1
    with jax.default_matmul_precision("bfloat16"):  # traced under other settings: not loaded
        np.testing.assert_array_equal(warm.Program(jax.jit(_double), key)(x), [0, 2, 4, 6])
    assert metrics.snapshot()["programs_loaded_by_key"] == before + 1
    # A call of another signature is served by jit, as without the key.
    np.testing.assert_array_equal(again(jnp.ones((2, 2))), [[2, 2], [2, 2]])
    for path in tmp_path.glob("ttpu_record_index-*"):
        path.write_bytes(compile_cache.MAGIC + bytes(32) + b"x")  # fails its digest
    with pytest.warns(CompileCacheWarning, match="unusable"):
        damaged = warm.Program(jax.jit(_double), key)
        np.testing.assert_array_equal(damaged(x), [0, 2, 4, 6])


def test_a_program_called_at_another_matmul_precision_runs_one_built_for_it(tmp_path, store_at,
                                                                          monkeypatch):
    # A capture under torch.tpu.precision(DEFAULT) that recorded the ops of one under HIGHEST
    # reuses its Program: the executable it first prepared (at HIGHEST) ran, float32 passes on
    # a TPU where bf16 ones were asked for (and the other way round).
    store_at(tmp_path)
    built = []
    compiled_for = warm.compiled_for

    def spy(jitted, key, args):
        built.append(str(jax.config.jax_default_matmul_precision))
        return compiled_for(jitted, key, args)

    monkeypatch.setattr(warm, "compiled_for", spy)
    program = warm.Program(jax.jit(jnp.matmul), warm_keys.key_of("test", "matmul"))
    x = jnp.ones((4, 4))
    with jax.default_matmul_precision("highest"):
        program(x, x)
    with jax.default_matmul_precision("bfloat16"):
        program(x, x)
    with jax.default_matmul_precision("highest"):
        program(x, x)  # back at the first precision: its executable, kept
    assert built == ["highest", "bfloat16"], built


def _draw(x):
    return jax.random.uniform(jax.random.PRNGKey(0), (4, 8)) + x


@pytest.mark.parametrize("setting", ["jax_threefry_partitionable", "jax_random_seed_offset"])
def test_a_program_loaded_by_key_computes_what_jax_settings_trace(tmp_path, store_at, setting):
    # A program is loaded by key untraced: a JAX setting that changes what its trace computes
    # (the random bits' layout, the seed's offset) is in the key, or a process started with
    # another value (JAX_THREEFRY_PARTITIONABLE=false) drew the numbers of the process that
    # wrote the entry.
    store_at(tmp_path)
    key = warm_keys.key_of("test", "draw")
    x = jnp.zeros(())
    program = warm.Program(jax.jit(_draw), key)
    first = np.asarray(program(x))
    other = {"jax_threefry_partitionable": not jax.config.jax_threefry_partitionable,
             "jax_random_seed_offset": 7}[setting]
    old = getattr(jax.config, setting)
    jax.config.update(setting, other)
    try:
        want = np.asarray(jax.jit(_draw)(x))
        assert not np.array_equal(want, first)
        # (a new Program, as in a new process: this one's first call looks the key up)
        np.testing.assert_array_equal(warm.Program(jax.jit(_draw), key)(x), want)
        np.testing.assert_array_equal(program(x), want)  # (one Program: one per setting)
    finally:
        jax.config.update(setting, old)
    np.testing.assert_array_equal(warm.Program(jax.jit(_draw), key)(x), first)


def test_directory_others_can_write_gets_no_records(tmp_path, store_at):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    store_at(shared)
    with pytest.warns(CompileCacheWarning, match=r"warm starts are off .* writable by others"):
        assert warm.read_record("index", "k") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per directory
        warm.write_record("index", "k", {"a": 1})
        np.testing.assert_array_equal(warm.Program(jax.jit(_double), warm_keys.key_of("t"))(
            jnp.ones(3)), [2, 2, 2])
    assert not list(shared.glob("ttpu_record_*"))
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    store_at(private)
    warm.write_record("index", "k", {"a": 1})
    assert warm.read_record("index", "k") == {"a": 1}


def test_torch_caches_only_in_a_private_directory(tmp_path, store_at, monkeypatch):
    """PyTorch's pickled caches of tpu graphs: never in a shared directory nor in one the user
    named for Inductor; in the private one under a key, old keys' directories pruned."""
    from torchtpu.compile import torch_caches

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHTPU_PLACED_INDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(torch_caches, "place", functools.cache(torch_caches.place.__wrapped__))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    store_at(shared)
    with pytest.warns(CompileCacheWarning, match="warm starts are off"):
        assert not torch_caches.place()
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    store_at(private)
    torch_caches.place.cache_clear()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with pytest.warns(CompileCacheWarning, match="TORCHINDUCTOR_CACHE_DIR=.* is set"):
        assert not torch_caches.place()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    torch_caches.place.cache_clear()
    for k in range(torch_caches.KEEP + 2):  # directories of older keys
        (private / "torch" / f"old{k}").mkdir(parents=True)
        os.utime(private / "torch" / f"old{k}", (k, k))
    assert torch_caches.place()
    ours = torch_caches.torch_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == ours
    assert ours.startswith(str(private.resolve() / "torch"))
    kept = sorted(p.name for p in (private / "torch").iterdir())
    newest = [f"old{k}" for k in range(3, torch_caches.KEEP + 2)]  # KEEP - 1 of them
    assert kept == sorted([os.path.basename(ours), *newest])
    # A child process inherits what place() set, with a private directory of its own: the
    # inherited value is torchtpu's, not the user's, so the child points it at its own.
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    store_at(other)
    torch_caches.place.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)
        assert torch_caches.place()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(other.resolve() / "torch"))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a directory another owner")
def test_directory_of_another_user_gets_no_records(tmp_path, store_at):
    other = tmp_path / "other"
    other.mkdir(mode=0o700)
    os.chown(other, 12345, -1)
    store_at(other)
    with pytest.warns(CompileCacheWarning, match="owned by uid 12345"):
        assert warm.read_record("index", "k") is None


def test_keys_refuse_what_has_no_stable_form():
    assert warm_keys.key_of("op", (1, 2), np.dtype("float32")) == warm_keys.key_of(
        "op", (1, 2), np.dtype("float32"))
    # A Python float and a float64 scalar make different programs (weak and strong types).
    assert warm_keys.key_of(1.5) != warm_keys.key_of(np.float64(1.5))
    assert warm_keys.key_of(jax.jit(_double)) is not None  # a module-level function
    assert warm_keys.key_of(lambda x: x) is None
    scale = 3
    assert warm_keys.key_of(jax.jit(lambda x: x * scale)) is None
    scaled = warm_keys.named(jax.jit(lambda x: x * scale), "scale", scale)
    assert warm_keys.key_of(scaled) is not None
    assert warm_keys.key_of(object()) is None


if __name__ == "__main__":
    _child(sys.argv[1])
