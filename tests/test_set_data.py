"""``tensor.data = other`` onto and off the tpu, as it works for CUDA: the tensor keeps its
identity, class, attributes and ``requires_grad`` and shares the new data's storage; FSDP2's
``fully_shard`` of a model built on CPU (which moves its parameters that way) trains as the CPU
model does."""

import pytest
import torch
from runners import ALL
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchtpu.demo.gpt import TinyGPT, train_steps


@pytest.mark.parametrize("to,back", [("tpu", "cpu"), ("cpu", "tpu")])
def test_data_moves_in_place_and_shares_the_new_storage(to, back):
    param = torch.nn.Parameter(torch.arange(4.0, device=back))
    param.marker = "kept"
    ident = id(param)
    new = torch.full((4,), 2.0, device=to)
    param.data = new
    assert id(param) == ident and type(param) is torch.nn.Parameter
    assert param.device.type == to and param.requires_grad and param.marker == "kept"
    new.add_(1)  # set_data leaves the two sharing storage
    assert param.cpu().tolist() == [3.0] * 4
    plain = torch.zeros(2, device=back)
    plain.data = torch.ones(2, device=to)
    assert type(plain) is torch.Tensor and plain.device.type == to and not plain.requires_grad


def test_data_move_with_a_grad_names_it():
    param = torch.nn.Parameter(torch.ones(3))
    param.sum().backward()
    with pytest.raises(RuntimeError, match="torchtpu.device: .* while it has a .grad"):
        param.data = torch.ones(3, device="tpu")


def test_other_refusals_stay_pytorchs():
    with pytest.raises(RuntimeError, match="incompatible tensor type"):
        torch.ones(2).data = torch.ones(2).to_sparse()


VOCAB, BLOCK, STEPS = 32, 8, 3


def _cpu_built_fsdp(rank, world, state, data):
    model = TinyGPT(VOCAB, BLOCK)  # on CPU: fully_shard moves it with .data =
    # The weights come from the caller: thread ranks share the global RNG, so seeding here
    # would interleave their draws.
    model.load_state_dict(state)
    mesh = init_device_mesh("tpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert all(p.device.type == "tpu" for p in model.parameters())
    return train_steps(model, data, STEPS, "tpu", shard=(rank, world))


@pytest.mark.parametrize("run", ALL)
def test_fsdp2_of_a_cpu_built_model_trains_as_on_cpu(run):
    data = torch.randint(VOCAB, (512,), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reference = TinyGPT(VOCAB, BLOCK)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    expected = train_steps(reference, data, STEPS, "cpu")
    losses = torch.tensor(run(_cpu_built_fsdp, 2, args=(state, data))).mean(0)
    torch.testing.assert_close(losses, torch.tensor(expected), atol=1e-5, rtol=1e-5)
