"""Scripts written for Google's TorchTPU run unchanged: the names its documentation uses
(``torch_tpu._internal.execution_mode``, ``.pallas``, ``.sync``, the single-host launcher, and
``torch.tpu``'s reference-only functions) do what the reference says, checked against CPU."""

import json
import os
import pickle
import subprocess
import sys
import textwrap
import warnings
from unittest import mock

import jax
import jax.numpy as jnp
import pytest
import torch
from jax.experimental import pallas as pl

import torchtpu
from torch_tpu._internal import execution_mode as em
from torch_tpu._internal import pallas, sync
from torch_tpu._internal.distributed.launchers import singlehost_wrapper
from torchtpu.runtime import compiler_options

_ROOT = os.path.dirname(os.path.dirname(torchtpu.__file__))


@pytest.fixture(autouse=True)
def _strict_after():
    yield
    torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_NEVER


def _chain(x: torch.Tensor) -> torch.Tensor:
    for _ in range(3):
        x = (x + 1.0) * 2.0 - 1.0
    return x


# ---------------------------------------------------------------------------- execution_mode


def test_eager_mode_assigned_entered_and_set_as_the_reference_writes_them():
    x = torch.randn(64, 64)
    em.eager_mode = em.EagerMode.DEFER_AND_FUSE
    assert em.get_eager_mode() is torch.tpu.eager_mode is em.EagerMode.DEFER_AND_FUSE
    y = _chain(x.to("tpu"))
    assert not torch.tpu.is_materialized(y)  # deferred: nothing ran yet
    torch.testing.assert_close(y.cpu(), _chain(x))
    with em.eager_mode(em.EagerMode.DEFER_NEVER):
        assert torch.tpu.eager_mode is em.EagerMode.DEFER_NEVER
        z = _chain(x.to("tpu"))
        assert torch.tpu.is_materialized(z)
    assert torch.tpu.eager_mode is em.EagerMode.DEFER_AND_FUSE
    with em.set_eager_mode(em.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert torch.tpu.eager_mode is em.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING
    assert torch.tpu.eager_mode is em.EagerMode.DEFER_AND_FUSE
    em.set_eager_mode(em.EagerMode.DEFER_NEVER)  # a plain call switches for good
    assert torch.tpu.eager_mode is em.EagerMode.DEFER_NEVER


def test_internal_defer_all_defers_every_op_until_a_read():
    assert em.EagerMode.INTERNAL_DEFER_ALL is em.EagerMode.DEFER_AND_FUSE
    x = torch.randn(8, 8)
    with em.eager_mode(em.EagerMode.INTERNAL_DEFER_ALL):
        a = torch.ones(8, 8, device="tpu")  # a factory is held too (a copy is no program)
        y = a @ x.to("tpu") + 3
        assert not torch.tpu.is_materialized(a) and not torch.tpu.is_materialized(y)
        torch.testing.assert_close(y.cpu(), torch.ones(8, 8) @ x + 3)


def test_defer_and_fuse_with_o1_warns_and_compiles_at_o1_while_on():
    x = torch.randn(16, 16)
    with pytest.warns(DeprecationWarning, match="torchtpu.config: EagerMode.DEFER_AND_FUSE_W"):
        with em.eager_mode(em.EagerMode.DEFER_AND_FUSE_WITH_O1):
            assert compiler_options.current().get("optimization_level") is not None
            torch.testing.assert_close(_chain(x.to("tpu")).cpu(), _chain(x))
    assert "optimization_level" not in compiler_options.current()


def test_defer_mode_the_older_names():
    em.set_defer_mode(em.DeferMode.NEVER)
    assert em.get_defer_mode() is em.DeferMode.NEVER
    assert torch.tpu.eager_mode is em.EagerMode.DEFER_NEVER
    with em.defer_mode(em.DeferMode.ALL):
        assert torch.tpu.eager_mode is em.EagerMode.DEFER_AND_FUSE
        assert em.get_defer_mode() is em.DeferMode.DEFAULT
    assert em.get_defer_mode() is em.DeferMode.NEVER
    with pytest.raises(TypeError, match="torchtpu.argument: a DeferMode"):
        em.set_defer_mode(em.EagerMode.DEFER_NEVER)


@torch.library.custom_op("fhref::twice", mutates_args=(), device_types="cpu")
def _twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_cpu_fallback_mode_allows_or_refuses_an_op_without_a_lowering():
    x = torch.arange(4.0)
    with em.cpu_fallback_mode(True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert em.is_cpu_fallback_enabled()
        torch.testing.assert_close(_twice(x.to("tpu")).cpu(), x * 2)
    with em.cpu_fallback_mode(False), pytest.raises(NotImplementedError, match="fhref.twice"):
        _twice(x.to("tpu"))


@pytest.mark.parametrize("variable, mode", [
    ("TPU_LAUNCH_BLOCKING", "DEFER_NEVER_AND_LAUNCH_BLOCKING"),
    ("TPU_DEFER_AND_FUSE", "DEFER_AND_FUSE"),
    ("TORCH_TPU_DEFER_AND_FUSE", "DEFER_AND_FUSE")])
def test_the_reference_variables_pick_the_starting_mode(variable, mode):
    code = "import torch; torch.ones(1, device='tpu'); print(torch.tpu.eager_mode.name)"
    env = {**os.environ, variable: "1", "PYTHONPATH": _ROOT}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == mode


# ---------------------------------------------------------------------------- pallas


def _added(x: jax.Array, y: jax.Array) -> jax.Array:
    def kernel(x_ref, y_ref, o_ref):
        o_ref[...] = x_ref[...] + y_ref[...]

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x, y)


def test_jax_op_from_torch_tpu_internal_pallas_eager_and_compiled():
    op = pallas.jax_op("fhref::added", _added)
    x, y = torch.randn(8, 128), torch.randn(8, 128)
    torch.testing.assert_close(op(x.to("tpu"), y.to("tpu")).cpu(), x + y)
    compiled = torch.compile(lambda a, b: op(a, b) * 2, backend="tpu")
    torch.testing.assert_close(compiled(x.to("tpu"), y.to("tpu")).cpu(), (x + y) * 2)


def _unannotated(a, b, alpha, mode):
    scaled = a + alpha * b
    return {"scaled": scaled, "pair": (a * b, jnp.maximum(a, b) if mode == "max" else a - b)}


def test_custom_jax_kernel_takes_unannotated_functions_statics_and_nested_results():
    kernel = pallas.custom_jax_kernel(_unannotated, static_argnums=(2, 3))
    a, b = torch.randn(5, 3), torch.randn(5, 3)
    for alpha, mode in ((2.0, "max"), (0.5, "sub")):  # each static value its own program
        out = kernel(a.to("tpu"), b.to("tpu"), alpha, mode)
        torch.testing.assert_close(out["scaled"].cpu(), a + alpha * b)
        torch.testing.assert_close(out["pair"][0].cpu(), a * b)
        torch.testing.assert_close(out["pair"][1].cpu(),
                                   torch.maximum(a, b) if mode == "max" else a - b)
    with pytest.raises(TypeError, match="torchtpu.argument: .*argument 2 is a float"):
        pallas.custom_jax_kernel(_unannotated)(a.to("tpu"), b.to("tpu"), 2.0, "max")


def test_custom_jax_kernel_as_a_decorator_is_differentiable():
    @pallas.custom_jax_kernel(name="softplus_sum")
    def softplus_sum(x, y):
        return jax.nn.softplus(x) * y

    x = torch.randn(6, requires_grad=True)
    y = torch.randn(6)
    xt = x.detach().to("tpu").requires_grad_()
    softplus_sum(xt, y.to("tpu")).sum().backward()
    (torch.nn.functional.softplus(x) * y).sum().backward()
    torch.testing.assert_close(xt.grad.cpu(), x.grad)


def test_custom_kernel_runs_a_pallas_kernel_with_outputs_shaped_by_propagate():
    @pallas.custom_kernel(lambda a, b: (torch.empty_like(a), torch.empty_like(a)))
    def sum_and_difference(a_ref, b_ref, s_ref, d_ref):
        s_ref[...] = a_ref[...] + b_ref[...]
        d_ref[...] = a_ref[...] - b_ref[...]

    for shape in ((8, 128), (16, 128)):
        a, b = torch.randn(shape), torch.randn(shape)
        s, d = sum_and_difference(a.to("tpu"), b.to("tpu"))
        torch.testing.assert_close(s.cpu(), a + b)
        torch.testing.assert_close(d.cpu(), a - b)


# ---------------------------------------------------------------------------- sync


def test_synchronize_runs_what_the_tensors_need_with_and_without_waiting():
    x = torch.randn(32, 32)
    with em.eager_mode(em.EagerMode.DEFER_AND_FUSE):
        y, z = _chain(x.to("tpu")), x.to("tpu") * 3
        assert not torch.tpu.is_materialized(y)
        sync.synchronize([y], wait=True)
        assert sync.is_materialized(y)
        w = y + 1
        sync.synchronize(w)  # one tensor; wait=False starts it
        assert sync.is_materialized(w)
        sync.synchronize()
        assert sync.is_materialized(z)
    torch.testing.assert_close(w.cpu(), _chain(x) + 1)


# ---------------------------------------------------------------------------- launcher


def test_singlehost_wrapper_prints_the_world_for_torchrun():
    run = [sys.executable, "-m", "torch_tpu._internal.distributed.launchers.singlehost_wrapper"]
    env = {**os.environ, "PYTHONPATH": _ROOT}
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["WORLD_SIZE=1"]  # no TPU chips here: one XLA:CPU process
    two = subprocess.run([*run, "2"], env=env, capture_output=True, text=True, timeout=300)
    assert two.stdout.splitlines() == ["WORLD_SIZE=2"]


def _scaled_sum(scale, x):
    return float(sum(x) * scale)


def test_prepare_tpu_environment_and_the_worker_wrapper():
    # It sets this process's variables, as asked; they must not outlive the test (a WORLD_SIZE
    # of 2 made a later Trainer in this worker start a two-process CPU group). monkeypatch's
    # delenv of an unset variable restores nothing, so the whole environment is put back.
    with mock.patch.dict(os.environ):
        os.environ.pop("WORLD_SIZE", None)
        wrapper = singlehost_wrapper.tpu_env_wrapper(_scaled_sum, 3, world_size=2)
        assert os.environ["WORLD_SIZE"] == "2"
    again = pickle.loads(pickle.dumps(wrapper))  # torchrun's workers receive it pickled
    assert again([1, 2]) == 9.0 and again.__name__ == "_scaled_sum"
    with pytest.raises(ValueError, match="torchtpu.argument: world_size"):
        singlehost_wrapper.prepare_tpu_environment(0)


# ---------------------------------------------------------------------------- torch.tpu


def test_the_reference_device_queries():
    x = torch.ones(2, device="tpu")
    assert torch.tpu.get_compute_capability() == ""
    attributes = torch.tpu.get_local_device_attributes()
    assert attributes["platform"] == "cpu" and attributes["id"] == 0
    assert torch.tpu.is_triton_capable() is False and torch.tpu.is_gpu() is False
    with torch.tpu.device_of(x):
        assert torch.tpu.current_device() == 0
    with torch.tpu.device_of(torch.ones(1)):  # not a tpu tensor: nothing changes
        pass
    assert torch.tpu.exchange_device(0) == 0 and torch.tpu.exchange_device(-1) == -1
    assert torch.tpu.maybe_exchange_device(0) == 0
    with pytest.raises(RuntimeError, match="torchtpu.device: invalid tpu device index 5"):
        torch.tpu.exchange_device(5)
    summary = torch.tpu._hbm_usage_summary()
    assert summary.startswith("device memory of CPU (cpu)") and "allocated_bytes" in summary


_CACHE_PROBE = """
    import json, os, torch
    stats = torch.tpu._get_cache_stats
    x = torch.arange(6.0, device="tpu")
    first = (x * 3).sum().item()  # compiled and written
    torch.tpu._clear_cache()
    before = stats()
    again = (x * 3).sum().item()  # read back from the cache
    hits = stats().num_cache_hits - before.num_cache_hits
    torch.tpu._set_cache_only(True)
    refused = ""
    try:
        (x - 7).sum().item()  # never compiled: refused
    except Exception as e:
        refused = str(e)
    torch.tpu._set_cache_only(False)
    torch.tpu._set_dump_on_cache_miss(True, os.environ["MISSES"])
    (x / 9).sum().item()  # a miss: dumped
    torch.tpu._clear_cache()
    (x * 3).sum().item()  # a hit: not dumped
    torch.tpu._set_dump_on_cache_miss(False)
    dumped = sorted(p.split("-", 1)[1] for p in os.listdir(os.environ["MISSES"]))
    torch.tpu._set_allow_cache(False)
    files = len(os.listdir(os.environ["TORCHTPU_CACHE_DIR"]))
    (x + 11).sum().item()  # compiled, not written
    unwritten = len(os.listdir(os.environ["TORCHTPU_CACHE_DIR"])) == files
    print(json.dumps([first, again, hits, refused, dumped, unwritten]))
"""


def test_cache_controls_of_the_reference(tmp_path):
    env = {**os.environ, "PYTHONPATH": _ROOT, "TORCHTPU_CACHE_DIR": str(tmp_path / "cache"),
           "MISSES": str(tmp_path / "misses")}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_CACHE_PROBE)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, again, hits, refused, dumped, unwritten = json.loads(out.stdout.splitlines()[-1])
    assert first == again == 45.0 and hits >= 1
    assert refused.startswith("torchtpu.cache: torch.tpu._set_cache_only(True) is on"), refused
    assert any("div" in name for name in dumped) and not any("mul" in name for name in dumped)
    assert all(name.endswith((".stablehlo.mlir", ".hlo.txt")) for name in dumped)
    assert unwritten
