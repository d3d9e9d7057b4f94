"""Device storages: in-place writes donate the old buffer; storages never share one."""

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
