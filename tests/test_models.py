"""A GPT-style model on tpu: training matches CPU step by step; saving, loading, copying, moving."""

import copy
import io

import pytest
import torch

from torchtpu.demo.gpt import TinyGPT, train_steps
from torchtpu.testing.compare import assert_same

CONFIG = dict(vocab=40, block=16, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture
def data():
    return torch.randint(0, CONFIG["vocab"], (600,), generator=torch.Generator().manual_seed(1))


def cpu_and_tpu_models():
    """The same initial weights on CPU and on tpu; the tpu one is built on the device."""
    cpu = TinyGPT(**CONFIG)
    with torch.device("tpu"):
        tpu = TinyGPT(**CONFIG)
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu


def assert_tied(model: TinyGPT) -> None:
    tied = model.head.weight is model.tok_emb.weight
    assert tied, "head.weight is no longer the same Parameter as tok_emb.weight"


@pytest.mark.parametrize("fused", [None, True], ids=["default", "fused"])
def test_training_matches_cpu(data, fused):
    cpu, tpu = cpu_and_tpu_models()
    assert_tied(tpu)
    assert tpu.head.weight.device.type == "tpu"
    expected = train_steps(cpu, data, 5, "cpu", fused=fused)
    actual = train_steps(tpu, data, 5, "tpu", fused=fused)
    assert expected[-1] < expected[0]  # it did learn something, so the comparison means something
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), rtol=1e-3, atol=0)
    # Adam divides by sqrt(v): a near-zero gradient's rounding moves its weight by up to ~lr.
    assert_same(tpu.state_dict(), cpu.state_dict(), rtol=1e-3, atol=1e-4)


def _save_and_load(model, map_location: str) -> dict:
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, map_location=map_location)


def test_state_dict_round_trip_through_torch_save():
    _, tpu = cpu_and_tpu_models()
    loaded = _save_and_load(tpu, "tpu")
    assert all(t.device.type == "tpu" for t in loaded.values())
    assert_same(loaded, tpu.state_dict(), atol=0, rtol=0)
    # torch.save keeps storage sharing: the tied weights come back as one storage.
    assert loaded["head.weight"].untyped_storage().data_ptr() == \
        loaded["tok_emb.weight"].untyped_storage().data_ptr()

    torch.manual_seed(123)
    with torch.device("tpu"):
        fresh = TinyGPT(**CONFIG)
    fresh.load_state_dict(loaded)
    idx = torch.randint(0, CONFIG["vocab"], (2, 8))
    assert_same(fresh(idx.to("tpu"))[0], tpu(idx.to("tpu"))[0].cpu(), atol=0, rtol=0)


def test_torch_load_of_tpu_checkpoint_to_cpu():
    _, tpu = cpu_and_tpu_models()
    loaded = _save_and_load(tpu, "cpu")
    assert all(t.device.type == "cpu" for t in loaded.values())
    assert_same(tpu.state_dict(), loaded, atol=0, rtol=0)


def test_deepcopy_of_tpu_model():
    _, tpu = cpu_and_tpu_models()
    clone = copy.deepcopy(tpu)
    assert_tied(clone)
    assert clone.tok_emb.weight.device.type == "tpu"
    assert_same(clone.state_dict(), tpu.state_dict(), atol=0, rtol=0)
    before = tpu.ln_f.weight.detach().cpu()
    with torch.no_grad():
        clone.ln_f.weight.add_(1.0)
    # The copy owns its storages: changing it leaves the original alone.
    assert_same(tpu.ln_f.weight, before, atol=0, rtol=0)


def test_deepcopy_of_tpu_tensors_keeps_views():
    base = torch.arange(12.0).to("tpu")
    copied = copy.deepcopy({"base": base, "view": base[4:8]})
    assert copied["view"].untyped_storage().data_ptr() == \
        copied["base"].untyped_storage().data_ptr()
    assert copied["base"].untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
    assert_same(copied, {"base": torch.arange(12.0), "view": torch.arange(4.0, 8.0)})


def test_module_to_tpu_and_back():
    cpu = TinyGPT(**CONFIG)
    expected = copy.deepcopy(cpu.state_dict())
    moved = cpu.to("tpu")
    assert all(p.device.type == "tpu" for p in moved.parameters())
    assert_same(moved.state_dict(), expected, atol=0, rtol=0)
    back = moved.cpu()
    assert all(p.device.type == "cpu" for p in back.parameters())
    assert_same(back.state_dict(), expected, atol=0, rtol=0)


def test_module_to_tpu_keeps_tied_weights():
    model = TinyGPT(**CONFIG).to("tpu")
    assert_tied(model)


def test_moves_keep_tied_weights_and_other_conversions_keep_pytorchs_path():
    model = TinyGPT(**CONFIG).to("tpu")
    assert_tied(model.cpu())
    assert_tied(model.tpu())
    with torch.device("meta"):
        on_meta = TinyGPT(**CONFIG)
    assert_tied(on_meta.to_empty(device="tpu"))
    # Not a move: PyTorch's `.data =` path, which a live autograd graph does not block (a swap
    # refuses a parameter the graph holds), on CPU and on tpu alike.
    for device in ("cpu", "tpu"):
        conv = torch.nn.Conv2d(4, 4, 3).to(device)
        out = conv(torch.randn(1, 4, 8, 8, device=device))
        weight = conv.weight
        conv.to(memory_format=torch.channels_last)
        assert conv.weight is weight
        assert conv.weight.is_contiguous(memory_format=torch.channels_last)
        out.sum().backward()


def test_lazy_module_moved_to_tpu_materializes_as_on_cpu():
    # The move swaps parameters in place; an UninitializedParameter must stay one, else the
    # lazy module's first forward sees a 0-element weight.
    cpu = torch.nn.LazyConv2d(4, 2)
    tpu = torch.nn.LazyConv2d(4, 2).to("tpu")
    assert torch.nn.parameter.is_lazy(tpu.weight)
    x = torch.randn(2, 3, 5, 5)
    tpu(x.to("tpu"))  # materializes on the device
    assert type(tpu.weight) is torch.nn.Parameter and tpu.weight.device.type == "tpu"
    expected = cpu(x)
    tpu.load_state_dict(cpu.state_dict())
    assert_same(tpu(x.to("tpu")), expected)


def test_lazy_module_converted_on_tpu_before_its_first_forward():
    # .double() of a tpu lazy module copies its placeholders, whose Python shape refuses to
    # answer: the device's copy read it and raised (test_modules' Lazy* float64 tests).
    cpu = torch.nn.LazyLinear(3).double()
    tpu = torch.nn.LazyLinear(3).to("tpu").double()
    assert torch.nn.parameter.is_lazy(tpu.weight)
    x = torch.randn(2, 4, dtype=torch.float64)
    tpu(x.to("tpu"))
    assert tpu.weight.dtype == torch.float64 and tpu.weight.shape == (3, 4)
    expected = cpu(x)
    tpu.load_state_dict(cpu.state_dict())
    assert_same(tpu(x.to("tpu")), expected)
