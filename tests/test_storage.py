"""Device storages: in-place writes donate the old buffer; storages never share one."""

import pytest
import torch


def _array(t):
    return t.untyped_storage()._tpu_array


def test_view_write_donates_old_buffer():
    x = torch.arange(4096, dtype=torch.float32).to("tpu")
    before = _array(x)
    x[1:3].add_(1)
    assert before.is_deleted(), "a view write must reuse the storage buffer, not copy it"
    expected = torch.arange(4096, dtype=torch.float32)
    expected[1:3] += 1
    torch.testing.assert_close(x.cpu(), expected)


def test_clone_and_copy_do_not_share_buffers():
    x = torch.arange(8, dtype=torch.float32).to("tpu")
    y = torch.empty(8, device="tpu")
    y.copy_(x)
    assert _array(y) is not _array(x)
    x[0:2].mul_(0)  # donates x's buffer; y must be unaffected
    torch.testing.assert_close(y.cpu(), torch.arange(8, dtype=torch.float32))


def test_cpu_copy_never_aliases_device_buffer():
    x = torch.arange(8, dtype=torch.float32).to("tpu")
    host = x.cpu()
    x[0:4].add_(100)
    torch.testing.assert_close(host, torch.arange(8, dtype=torch.float32))


def test_storage_addresses_do_not_overlap():
    a = torch.empty(100, device="tpu")
    b = torch.empty(100, device="tpu")
    lo, hi = sorted([a.data_ptr(), b.data_ptr()])
    assert hi >= lo + 400


def test_storage_resize_is_in_place_and_keeps_bytes():
    x = torch.arange(8, dtype=torch.float32).to("tpu")
    view = x[2:4]
    st = x.untyped_storage()
    st.resize_(48)
    assert x.untyped_storage().nbytes() == 48 and view.untyped_storage().nbytes() == 48
    torch.testing.assert_close(x.cpu(), torch.arange(8, dtype=torch.float32))
    torch.testing.assert_close(view.cpu(), torch.tensor([2.0, 3.0]))
    grown = torch.empty(0, device="tpu").set_(st, 0, (12,), (1,))
    torch.testing.assert_close(grown.cpu()[8:], torch.zeros(4))  # new bytes read as zeros
    st.resize_(8)  # shrinking keeps the leading bytes
    torch.testing.assert_close(x[:2].cpu(), torch.tensor([0.0, 1.0]))


def test_storage_resize_to_zero_frees_and_reallocates():
    # FSDP2's way of freeing an unsharded parameter and bringing it back.
    x = torch.arange(1024, dtype=torch.float32).to("tpu")
    before = torch.tpu.memory_allocated()
    x.untyped_storage().resize_(0)
    assert x.untyped_storage().nbytes() == 0 and _array(x) is None
    assert torch.tpu.memory_allocated() <= before - 4096
    x.untyped_storage().resize_(4096)
    x.copy_(torch.ones(1024))
    torch.testing.assert_close(x.cpu(), torch.ones(1024))


def test_tensor_past_its_resized_storage_raises():
    x = torch.arange(8, dtype=torch.float32).to("tpu")
    x.untyped_storage().resize_(0)
    for use in (lambda: (x + 1).cpu(), x.cpu):
        with pytest.raises(RuntimeError, match="reaches byte 32 of its storage, which holds 0"):
            use()
    with pytest.raises(ValueError, match="byte count >= 0"):
        x.untyped_storage().resize_(-1)


def test_tensor_resize_grows_the_shared_storage():
    x = torch.arange(4, dtype=torch.float32).to("tpu")
    alias = x.view(4)
    x.resize_(6)
    assert alias.untyped_storage().nbytes() == 24  # the same storage, grown in place
    torch.testing.assert_close(x.cpu()[:4], torch.arange(4, dtype=torch.float32))


def _layouts(device):
    x = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).reshape(2, 3, 4, 5).to(device)
    cl = x.contiguous(memory_format=torch.channels_last)
    same = torch.randn(6, 4, device=device).t()
    same_strides = same.stride()
    same.resize_as_(same)  # the same sizes keep the strides
    made = {
        "empty": torch.empty(2, 3, 4, 5, device=device, memory_format=torch.channels_last),
        "contiguous": cl, "clone": x.clone(memory_format=torch.channels_last),
        "resize_": torch.zeros(120, device=device).resize_(
            (2, 3, 4, 5), memory_format=torch.channels_last),
        "resize_3d": torch.zeros(360, device=device).resize_(
            (3, 2, 3, 4, 5), memory_format=torch.channels_last_3d),
        "resize_as_preserve": torch.zeros(120, device=device).resize_as_(
            cl, memory_format=torch.preserve_format),
    }
    strides = {k: v.stride() for k, v in made.items()}
    strides["same_sizes"] = (same_strides, same.stride())
    return strides, cl.cpu()


def test_memory_formats_give_cpu_strides():
    actual, values = _layouts("tpu")
    expected, cpu_values = _layouts("cpu")
    assert actual == expected
    torch.testing.assert_close(values, cpu_values)
    with pytest.raises(RuntimeError, match="required rank 4 tensor to use channels_last"):
        torch.zeros(6, device="tpu").resize_((2, 3), memory_format=torch.channels_last)


@pytest.mark.parametrize("args", [(), (0,), (5,), ([1, 2, 255, 0, 256, -1],)])
def test_storage_constructors_take_cpus_arguments(args):
    untyped = torch.UntypedStorage(*args, device="tpu")
    assert untyped.device.type == "tpu"
    cpu = torch.UntypedStorage(*args)
    assert untyped.nbytes() == cpu.nbytes()
    if args and isinstance(args[0], list):
        assert untyped.tolist() == cpu.tolist()
    typed = torch.TypedStorage(*args, dtype=torch.float32, device="tpu")
    typed_cpu = torch.TypedStorage(*args, dtype=torch.float32)
    assert typed.size() == typed_cpu.size()
    if args and isinstance(args[0], list):
        assert typed.tolist() == typed_cpu.tolist()


def test_storage_constructor_refuses_what_cpu_refuses():
    with pytest.raises(RuntimeError) as cpu:
        torch.UntypedStorage([1, 2.5])
    with pytest.raises(RuntimeError) as tpu:
        torch.UntypedStorage([1, 2.5], device="tpu")
    assert str(tpu.value) == str(cpu.value)


def test_storage_slices_read_their_storage_bytes_as_cpu_slices_do():
    # PyTorch's test_storage reads a tensor's bytes through storage()[a:b] (bytes_to_scalar).
    host = torch.arange(6, dtype=torch.float32)
    t = host.to("tpu")
    tpu, cpu = t.untyped_storage(), host.untyped_storage()
    assert list(tpu[4:8]) == list(cpu[4:8]) == [0, 0, 128, 63]
    assert tpu[4:12][4:8].tolist() == cpu[4:12][4:8].tolist()  # a slice of a slice
    assert len(tpu[4:8]) == 4 and tpu[4:8].device.type == "tpu"
    part = tpu[4:8]
    t.add_(1)  # a slice sees later writes to its storage, as a CPU slice shares its memory
    host.add_(1)
    assert list(part) == list(cpu[4:8]) == [0, 0, 0, 64]


def test_storage_slice_writes_are_refused_in_words():
    storage = torch.arange(8, dtype=torch.uint8, device="tpu").untyped_storage()
    part = storage[2:4]
    with pytest.raises(NotImplementedError, match=r"writing through a slice of a tpu storage"):
        torch.empty(0, dtype=torch.uint8, device="tpu").set_(part).fill_(9)
    assert list(storage) == list(range(8))


def test_legacy_storage_classes_on_torch_tpu_make_tpu_storages():
    # PyTorch's storage_type() looks for torch.<privateuse1 name>.FloatStorage; without the
    # class it is None for a tpu tensor.
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage's deprecation
        t = torch.ones(3, dtype=torch.bfloat16, device="tpu")
        assert t.storage_type() is torch.tpu.BFloat16Storage
        assert torch.ones(3, device="tpu").storage_type() is torch.tpu.FloatStorage
        s = torch.tpu.LongStorage([1, 2, 3])
        assert s.device.type == "tpu" and s.dtype is torch.int64 and s.tolist() == [1, 2, 3]
        assert isinstance(t.storage(), torch.tpu.BFloat16Storage)
        assert not isinstance(t.storage(), torch.BFloat16Storage)


def test_is_set_to_compares_storage_offset_sizes_and_strides_as_cpu():
    for device in ("cpu", "tpu"):
        t1 = torch.empty(3, 4, device=device)
        t3 = torch.tensor([], device=device).set_(t1)
        assert t1.is_set_to(t3) and t3.is_set_to(t1)
        assert not t1.is_set_to(torch.empty(3, 4, device=device))  # another storage
        assert not t1.is_set_to(t1.view(4, 3))  # sizes
        assert not t1.is_set_to(t1.t().contiguous().t())  # strides, another storage
        assert not t1.is_set_to(t3[1:])  # offset


def _uninitialized(device, dtype):
    """What allocations read in deterministic mode: the factories, empty(out=) and the new
    elements of a resize_ (the first three were written as zeros before it)."""
    from torch.testing._internal.common_utils import DeterministicGuard

    with DeterministicGuard(True):
        grown = torch.zeros(3, dtype=dtype, device=device)
        grown.resize_(2, 4)
        made = [torch.empty(2, 3, dtype=dtype, device=device),
                torch.empty_strided((2, 3), (1, 2), dtype=dtype, device=device),
                torch.empty((1, 2, 2, 2), dtype=dtype, device=device,
                            memory_format=torch.channels_last),
                torch.empty_like(torch.zeros(4, dtype=dtype, device=device)),
                torch.empty(5, dtype=dtype, device=device, out=torch.zeros(1, dtype=dtype,
                                                                          device=device)),
                grown]
    return [t.cpu() for t in made]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex64, torch.int32,
                                   torch.uint8, torch.bool])
def test_deterministic_mode_fills_uninitialized_memory_as_cpu(dtype):
    """torch.use_deterministic_algorithms(True) fills what an allocation hands out unwritten
    (NaN, the dtype's largest value, True), as CPU does; PyTorch's test_deterministic_empty and
    test_deterministic_resize check it for every dtype."""
    for tpu, cpu in zip(_uninitialized("tpu", dtype), _uninitialized("cpu", dtype), strict=True):
        torch.testing.assert_close(tpu, cpu, rtol=0, atol=0, equal_nan=True)


def test_filling_is_off_outside_deterministic_mode_or_when_turned_off():
    from torch.testing._internal.common_utils import DeterministicGuard

    assert torch.empty(3, device="tpu").eq(0).all()  # no fill program outside deterministic mode
    with DeterministicGuard(True, fill_uninitialized_memory=False):
        assert torch.empty(3, device="tpu").eq(0).all()
        grown = torch.zeros(1, device="tpu")
        grown.resize_(4)
        assert grown.eq(0).all()


def test_storage_addresses_never_overlap_and_a_mark_orders_them(monkeypatch):
    """Small storages take blocks of the upper region from a counter, larger ones (and any once
    that region is used up) the lower region under a lock: no two ranges overlap, and a
    capture's ``mark`` tells the storages made after it from those made before, in either."""
    from torchtpu.device import storage as storages

    def made():
        return [storages.new_storage(n) for n in (0, 1, 100, storages._BLOCK,
                                                  storages._BLOCK + 1, 3 * storages._BLOCK)]

    before = made()
    mark = storages.mark()
    after = made()
    # The upper region used up: a small storage goes below, still after the mark.
    monkeypatch.setattr(storages, "_SMALL_BLOCKS", 0)
    below = made()
    monkeypatch.undo()
    assert all(s.data_ptr() < storages._SMALL_BASE for s in below)
    assert [s.data_ptr() >= storages._SMALL_BASE for s in after] == [True] * 4 + [False] * 2
    after += below
    spans = sorted((s.data_ptr(), s.data_ptr() + max(s.nbytes(), 1)) for s in before + after)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert all(storages.made_since(mark, s.data_ptr()) for s in after)
    assert not any(storages.made_since(mark, s.data_ptr()) for s in before)
