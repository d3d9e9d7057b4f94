"""deepcopy, torch.save/torch.load and state_dict round trips of tpu tensors and modules."""

import copy
import io

import torch


def test_deepcopy_copies_storage():
    x = torch.arange(6.0).to("tpu")
    y = copy.deepcopy(x)
    assert y.device.type == "tpu"
    y.add_(1)
    torch.testing.assert_close(x.cpu(), torch.arange(6.0))
    torch.testing.assert_close(y.cpu(), torch.arange(6.0) + 1)


def test_save_load_keeps_sharing_and_maps_locations():
    x = torch.arange(6.0).to("tpu")
    buf = io.BytesIO()
    torch.save({"x": x, "tail": x[2:]}, buf)
    for location, device in (("tpu", "tpu"), ("cpu", "cpu"), (None, "tpu")):
        buf.seek(0)
        d = torch.load(buf, map_location=location)
        assert d["x"].device.type == device
        torch.testing.assert_close(d["tail"].cpu(), torch.arange(2.0, 6.0))
        d["tail"].mul_(10)  # the view still shares the loaded storage
        assert d["x"][2].item() == 20.0


def test_module_state_dict_round_trip():
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    dev = copy.deepcopy(src).to("tpu")
    buf = io.BytesIO()
    torch.save(dev.state_dict(), buf)
    buf.seek(0)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    fresh = fresh.to("tpu")
    fresh.load_state_dict(torch.load(buf, map_location="tpu"))
    x = torch.randn(5, 3)
    torch.testing.assert_close(fresh(x.to("tpu")).cpu(), src(x), atol=1e-6, rtol=1e-5)
    clone = copy.deepcopy(fresh)
    assert all(p.device.type == "tpu" for p in clone.parameters())
