"""torch.tpu: the reference's device API, the accelerator hooks, and errors for bad input."""

import pytest
import torch

import torchtpu


def test_device_functions():
    assert torch.tpu.is_available()
    assert torch.tpu.device_count() >= 1
    assert torch.tpu.current_device() == 0
    torch.tpu.set_device(0)
    assert isinstance(torch.tpu.get_device_name(), str)
    props = torch.tpu.get_device_properties(0)
    assert props.total_memory > 0 and props.name
    assert torch.accelerator.current_accelerator() == torch.device("tpu")
    assert torch._utils._get_available_device_type() == "tpu"
    torch.tpu.synchronize()


def test_bad_device_index_raises():
    n = torch.tpu.device_count()
    with pytest.raises(RuntimeError, match="invalid tpu device index"):
        torch.tpu.set_device(n)
    with pytest.raises(RuntimeError, match="invalid tpu device index"):
        torch.empty(2, device=f"tpu:{n}")


def test_unsupported_dtype_raises():
    with pytest.raises(TypeError, match="float8_e8m0fnu is not supported on the tpu device"):
        torch.empty(2, dtype=torch.float8_e8m0fnu, device="tpu")


def test_quantized_tensors_are_refused_by_name():
    with pytest.raises(TypeError, match=r"torchtpu.dtype: quantized tensors \(torch.qint8\)"):
        torch.empty(2, dtype=torch.qint8, device="tpu")
    q = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.quint8)
    with pytest.raises(TypeError, match=r"quantized tensors \(torch.quint8\).*int_repr"):
        q.to("tpu")


def test_mixed_devices_raise_like_cuda():
    a = torch.zeros(3, device="tpu")
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        a + torch.ones(3)
    # A 0-dim CPU tensor is a scalar, as on CUDA.
    torch.testing.assert_close((a + torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))
    # Also inside a foreach op's list (a compiled optimizer's eager fallback passes such lists).
    out = torch._foreach_mul([a, a[:2]], [torch.tensor(2.0), torch.tensor(3)])
    torch.testing.assert_close([o.cpu() for o in out], [torch.zeros(3), torch.zeros(2)])
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch._foreach_mul([a], [torch.ones(3)])


# An op with a CPU kernel and no tpu lowering or decomposition: what the CPU fallback serves.
_lib = torch.library.Library("torchtpu_test", "DEF")
_lib.define("scaled_cumsum(Tensor x, float scale) -> Tensor")
_lib.impl("scaled_cumsum", lambda x, scale: torch.cumsum(x, 0) * scale, "CPU")
_no_lowering = torch.ops.torchtpu_test.scaled_cumsum.default


def test_fallback_error_names_the_op(monkeypatch):
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "error")
    a = torch.ones(2, 3, device="tpu")
    with pytest.raises(NotImplementedError, match="torchtpu_test.scaled_cumsum.default"):
        _no_lowering(a, 2.0)


def test_fallback_counts_and_warns(monkeypatch):
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "warn")
    name = "torchtpu_test.scaled_cumsum.default"
    before = torchtpu.metrics.snapshot()["cpu_fallbacks"]
    a = torch.randn(4, 3)
    with pytest.warns(UserWarning, match="scaled_cumsum"):
        out = _no_lowering(a.to("tpu"), 2.0)
        _no_lowering(a.to("tpu"), 3.0)  # counted again, not only marked as seen
    assert out.device.type == "tpu"
    torch.testing.assert_close(out.cpu(), torch.cumsum(a, 0) * 2.0)
    after = torchtpu.metrics.snapshot()["cpu_fallbacks"]
    assert after == {**before, name: before.get(name, 0) + 2}
    assert f"{name}: {after[name]}" in torchtpu.metrics.report()


def test_metrics_count_transfers_and_executions():
    torchtpu.metrics.reset()
    x = torch.arange(6, dtype=torch.float32).to("tpu")
    y = (x * 2).cpu()
    snap = torchtpu.metrics.snapshot()
    assert snap["host_to_device_bytes"] >= 24
    assert snap["device_to_host_bytes"] >= 24
    assert snap["executions"] >= 1
    for key in ("executable_compiles", "compile_seconds", "cpu_fallbacks"):
        assert key in snap
    torch.testing.assert_close(y, torch.arange(6, dtype=torch.float32) * 2)


def test_rng_api_repeatable():
    torch.manual_seed(123)
    s = torch.tpu.get_rng_state()
    assert torch.tpu.initial_seed() == 123
    a = torch.rand(5, device="tpu").cpu()
    torch.tpu.set_rng_state(s)
    b = torch.rand(5, device="tpu").cpu()
    torch.testing.assert_close(a, b)
    g = torch.Generator(device="tpu")
    assert g.device == torch.device("tpu", 0)
    assert isinstance(g, torch.Generator)
    assert isinstance(torch.Generator(), torch.Generator)


def test_memory_allocated_tracks_live_tensors():
    before = torch.tpu.memory_allocated()
    x = torch.arange(1024 * 256, dtype=torch.float32).to("tpu")
    assert torch.tpu.memory_allocated() >= before + x.numel() * 4
    del x


def test_peak_memory_and_reset_as_cuda_reports_them():
    torch.tpu.reset_peak_memory_stats()
    base = torch.tpu.max_memory_allocated()
    nbytes = 4 * 1024 * 1024
    x = torch.ones(nbytes // 4, device="tpu") + 1
    torch.tpu.synchronize()
    peak = torch.tpu.max_memory_allocated()
    assert peak >= base + nbytes
    del x
    assert torch.tpu.max_memory_allocated() == peak  # a peak outlives the tensor
    torch.tpu.reset_peak_memory_stats()
    assert torch.tpu.max_memory_allocated() < peak
    stats = torch.tpu.memory_stats()
    for key in ("active_bytes.all.peak", "reserved_bytes.all.peak", "num_alloc_retries",
                "num_ooms", "allocated_bytes.all.current"):
        assert isinstance(stats[key], int)
    free, total = torch.tpu.mem_get_info()
    assert 0 < free <= total == torch.tpu.get_device_properties().total_memory
    assert torch.tpu.memory_reserved() >= torch.tpu.memory_allocated()
    torch.tpu.empty_cache()
    with pytest.raises(RuntimeError, match="invalid tpu device index"):
        torch.tpu.memory_allocated(5)


def test_item_print_and_bool():
    x = torch.tensor([1.5, -2.0]).to("tpu")
    assert x[0].item() == 1.5
    assert "device='tpu:0'" in repr(x)
    assert bool(x[0] > 0)


def test_accelerator_api_works_for_tpu():
    x = torch.ones(3, device="tpu") * 2
    torch.accelerator.synchronize()
    torch.accelerator.set_device_index(0)
    assert torch.accelerator.current_device_index() == 0
    with torch.device("tpu"):
        y = torch.zeros(2)
    assert y.device.type == "tpu"
    assert x.sum().item() == 6.0


def test_synchronize_waits_for_work_whose_results_were_dropped(monkeypatch):
    # As CUDA's: a timing loop that drops its results must not measure dispatch alone. The last
    # result's array is kept out of sight of the live arrays, so only waiting for every queued
    # program makes it ready.
    from torchtpu.device import control, tensors

    a = torch.randn(512, 512).to("tpu")
    (a @ a).cpu()
    for _ in range(20):
        last = a @ a
    array = tensors.storage_array(last)
    monkeypatch.setattr(control.jax, "live_arrays", lambda: [])
    torch.tpu.synchronize()
    assert array.is_ready()


def test_synchronize_tensors_materializes_pending_values():
    x = torch.arange(4.0).to("tpu")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        y = x * 3
        assert not torch.tpu.is_materialized(y)
        torch.tpu.synchronize([y])
        assert torch.tpu.is_materialized(y)
    torch.testing.assert_close(y.cpu(), torch.arange(4.0) * 3)


def _matmul_program_precision(a: torch.Tensor, b: torch.Tensor, monkeypatch) -> tuple:
    """a @ b on tpu, and the precision attribute of the dot in the program eager ran for it.

    XLA:CPU computes float32 dots exactly whatever the attribute says (TPUs and GPUs do not), so
    the program's text is what shows the setting reached the device."""
    from torchtpu.device.hooks import HOOKS

    texts = []

    def record(label, fn, args):
        if label == torch.ops.aten.mm.default:
            texts.append(fn.lower(*args).as_text())
        return fn(*args)

    monkeypatch.setattr(HOOKS, "launch_observer", record)
    out = (a.to("tpu") @ b.to("tpu")).cpu()
    monkeypatch.setattr(HOOKS, "launch_observer", None)
    (dot,) = [line for text in texts for line in text.splitlines() if "dot_general" in line]
    return out, dot[dot.index("precision = "):].split("]")[0] + "]"


def test_precision_api(monkeypatch):
    assert torch.tpu.get_precision() is torch.tpu.Precision.HIGHEST
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    exact, attribute = _matmul_program_precision(a, b, monkeypatch)
    assert attribute == "precision = [HIGHEST, HIGHEST]"
    torch.testing.assert_close(exact, a @ b, atol=1e-5, rtol=1.3e-6)
    with torch.tpu.precision(torch.tpu.Precision.DEFAULT):
        assert torch.tpu.get_precision() is torch.tpu.Precision.DEFAULT
        # The same op and shapes as above: a program of its own, not the cached HIGHEST one.
        low, attribute = _matmul_program_precision(a, b, monkeypatch)
        assert attribute == "precision = [DEFAULT, DEFAULT]"
    assert torch.tpu.get_precision() is torch.tpu.Precision.HIGHEST
    torch.testing.assert_close(low, a @ b, atol=0.1, rtol=0.05)  # bf16 passes on a TPU
    torch.set_float32_matmul_precision("high")
    try:
        assert torch.tpu.get_precision() is torch.tpu.Precision.HIGH
        _, attribute = _matmul_program_precision(a, b, monkeypatch)
        assert attribute == "precision = [HIGH, HIGH]"
    finally:
        torch.set_float32_matmul_precision("highest")
    assert torch.tpu.get_precision() is torch.tpu.Precision.HIGHEST
    with pytest.raises(TypeError, match="torch.tpu.Precision"):
        torch.tpu.set_precision("highest")


def test_every_factory_rejects_other_device_indices():
    for make in (lambda d: torch.ones(2, device=d), lambda d: torch.full((2,), 3.0, device=d),
                 lambda d: torch.arange(3, device=d), lambda d: torch.zeros(1).to(d)):
        with pytest.raises(RuntimeError, match="this process drives one device, tpu:0"):
            make("tpu:1")
