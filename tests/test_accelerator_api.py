"""Every ``torch.accelerator`` entry point works for device "tpu" (tpu/accelerator.py).

PyTorch's versions reach C++ bindings a Python backend cannot serve: Accelerate 1.16's
``free_memory`` called ``torch.accelerator.memory.empty_cache()`` and got "Allocator for tpu is
not a DeviceAllocator" (issue 37); ``empty_host_cache`` segfaulted. One case per public name of
``torch.accelerator`` and ``torch.accelerator.memory``; a name PyTorch adds fails the coverage
test until it has a case here.
"""

import collections

import pytest
import torch
import torch.accelerator
import torch.accelerator.memory


def _memory_figures():
    acc, mem = torch.accelerator, torch.accelerator.memory
    x = torch.ones(1 << 18, device="tpu")  # 1 MiB
    torch.tpu.synchronize()
    for module in (acc, mem):
        assert module.memory_allocated() == torch.tpu.memory_allocated()
        assert module.memory_allocated(0) == module.memory_allocated("tpu:0")
        assert module.memory_reserved() == torch.tpu.memory_reserved()
        assert module.max_memory_allocated() >= module.memory_allocated() >= x.nbytes
        assert module.max_memory_reserved() >= module.memory_reserved()
    before = acc.memory_allocated()
    del x
    assert before - acc.memory_allocated() == 1 << 20


def _memory_stats():
    for module in (torch.accelerator, torch.accelerator.memory):
        stats = module.memory_stats()
        assert isinstance(stats, collections.OrderedDict)
        assert stats == collections.OrderedDict(sorted(torch.tpu.memory_stats().items()))
        assert stats["allocated_bytes.all.current"] == module.memory_allocated()


def _peaks():
    for module in (torch.accelerator, torch.accelerator.memory):
        torch.ones(1 << 18, device="tpu").cpu()  # a peak above what stays
        module.reset_peak_memory_stats()
        assert module.max_memory_allocated() == module.memory_allocated()


def _counters(monkeypatch):
    from torchtpu.device import memory

    # The runtime's counters (PJRT's, none on XLA:CPU), which cannot be reset.
    counts = {}
    monkeypatch.setattr(memory, "_runtime_stats", lambda: dict(counts))
    for module in (torch.accelerator, torch.accelerator.memory):
        counts.update(num_allocs=7, num_ooms=2)
        monkeypatch.setattr(memory, "_counts_at_reset", {"num_allocs": 0, "num_ooms": 0})
        assert module.memory_stats()["num_ooms"] == 2
        module.reset_accumulated_memory_stats()
        assert module.memory_stats()["num_ooms"] == module.memory_stats()["num_device_alloc"] == 0
        counts["num_ooms"] += 1
        assert module.memory_stats()["num_ooms"] == 1


def _memory_info():
    for module in (torch.accelerator, torch.accelerator.memory):
        free, total = module.get_memory_info()
        assert total == torch.tpu.mem_get_info()[1] and 0 <= free <= total


def _caches():
    x = torch.ones(8, device="tpu")
    for module in (torch.accelerator, torch.accelerator.memory):
        module.empty_cache()
        module.empty_host_cache()  # segfaulted once a tpu tensor existed
    assert x.sum().item() == 8


def _capability():
    capability = torch.accelerator.get_device_capability()
    assert torch.accelerator.get_device_capability("tpu:0") == capability
    assert {torch.float32, torch.bfloat16, torch.int64, torch.bool} <= \
        capability["supported_dtypes"]
    for dtype in capability["supported_dtypes"]:
        assert torch.zeros(2, dtype=dtype, device="tpu").dtype == dtype


def _devices():
    acc = torch.accelerator
    assert acc.is_available() and acc.device_count() == torch.tpu.device_count() == 1
    assert acc.current_accelerator() == torch.device("tpu")
    assert acc.current_device_index() == 0
    with pytest.warns(FutureWarning):
        assert acc.current_device_idx() == 0
    acc.set_device_index(0)
    acc.set_device_index("tpu:0")
    with pytest.warns(FutureWarning):
        acc.set_device_idx(0)
    with pytest.raises(RuntimeError, match="invalid tpu device index 3"):
        acc.set_device_index(3)
    with pytest.raises(RuntimeError, match="invalid tpu device index 3"), \
            pytest.warns(FutureWarning):
        acc.set_device_idx(3)
    with acc.device_index(0):
        assert torch.ones(2, device="tpu").device == torch.device("tpu:0")
    with pytest.raises(ValueError, match="doesn't match the current accelerator"):
        acc.memory_allocated("cpu")


def _streams():
    stream = torch.accelerator.current_stream()
    assert stream.device == torch.device("tpu:0")
    torch.accelerator.set_stream(stream)
    x = torch.arange(4.0, device="tpu") * 2
    torch.accelerator.synchronize()
    torch.accelerator.synchronize(0)
    assert torch.tpu.is_materialized(x)


def _graph():
    y = torch.zeros(4, device="tpu")
    graph = torch.accelerator.Graph()
    with graph:
        y += 1
    graph.replay()
    graph.replay()
    stream, doubling = torch.Stream("tpu"), torch.accelerator.Graph(keep_graph=True)
    with stream, doubling:
        y.mul_(2)
    doubling.instantiate()
    doubling.replay()
    # as CUDA graphs: a capture records without running; ((0 + 1) + 1) * 2
    torch.testing.assert_close(y.cpu(), torch.full((4,), 4.0))
    assert torch.accelerator.graphs.Graph is torch.accelerator.Graph


_CASES = {
    "memory_allocated": _memory_figures, "max_memory_allocated": _memory_figures,
    "memory_reserved": _memory_figures, "max_memory_reserved": _memory_figures,
    "memory_stats": _memory_stats, "reset_peak_memory_stats": _peaks,
    "reset_accumulated_memory_stats": _counters, "get_memory_info": _memory_info,
    "empty_cache": _caches, "empty_host_cache": _caches,
    "get_device_capability": _capability,
    "is_available": _devices, "device_count": _devices, "current_accelerator": _devices,
    "current_device_index": _devices, "current_device_idx": _devices,
    "set_device_index": _devices, "set_device_idx": _devices, "device_index": _devices,
    "current_stream": _streams, "set_stream": _streams, "synchronize": _streams,
    "Graph": _graph,
}


def test_every_entry_point_has_a_case():
    names = set(torch.accelerator.__all__) | set(torch.accelerator.memory.__all__)
    assert names == set(_CASES), (names - set(_CASES), set(_CASES) - names)


@pytest.mark.parametrize("case", sorted(set(_CASES.values()), key=lambda f: f.__name__),
                         ids=lambda f: f.__name__.strip("_"))
def test_entry_point_works_for_tpu(case, monkeypatch):
    if case is _counters:
        case(monkeypatch)
    else:
        case()
