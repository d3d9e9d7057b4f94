"""deepcopy, torch.save/torch.load and state_dict round trips of tpu tensors and modules."""

import copy
import io
import pickle

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


def test_pickle_round_trip_of_device_tensors():
    # multiprocessing queues and spawned ranks' results pickle this way (not torch.save).
    view = torch.arange(6.0).view(2, 3).to("tpu")[:, 1:]
    half = torch.tensor([1.5, 2.0], dtype=torch.bfloat16, device="tpu")
    param = torch.nn.Parameter(torch.ones(2, device="tpu"))
    v, h, p = pickle.loads(pickle.dumps((view, half, param)))
    assert v.device.type == h.device.type == p.device.type == "tpu"
    assert v.stride() == (3, 1) and isinstance(p, torch.nn.Parameter) and p.requires_grad
    torch.testing.assert_close(v.cpu(), torch.tensor([[1.0, 2.0], [4.0, 5.0]]))
    torch.testing.assert_close(h.cpu(), torch.tensor([1.5, 2.0], dtype=torch.bfloat16))
    storage = pickle.loads(pickle.dumps(view.untyped_storage()))
    assert storage.device.type == "tpu" and storage.nbytes() == 24
