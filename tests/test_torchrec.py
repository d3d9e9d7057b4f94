"""TorchRec on tpu: ``EmbeddingBagCollection`` over a ``KeyedJaggedTensor``, forward and
backward, and a small DLRM trained with SGD, each equal to the same thing on CPU; FBGEMM's
cumsum ops (which ``KeyedJaggedTensor`` calls for its offsets) run through their lowerings, not
the CPU fallback (the suite runs with ``TORCHTPU_CPU_FALLBACK=error``).

Needs the ``torchrec`` extra with FBGEMM's CPU build (docs, TorchRec)."""

import pytest
import torch

try:
    import fbgemm_gpu  # noqa: F401
    import torchrec
    from torchrec.models.dlrm import DLRM
except (ImportError, OSError) as e:  # OSError: an FBGEMM built for another torch or for CUDA
    pytest.skip(f"TorchRec with fbgemm-gpu-cpu is not installed or does not load ({e}); "
                "install it as docs, TorchRec says", allow_module_level=True)

KEYS = ["f0", "f1"]
ROWS, DIM, BATCH = 16, 8, 4


def _tables() -> list:
    return [torchrec.EmbeddingBagConfig(name="t0", embedding_dim=DIM, num_embeddings=ROWS,
                                        feature_names=["f0"]),
            torchrec.EmbeddingBagConfig(name="t1", embedding_dim=DIM, num_embeddings=ROWS,
                                        feature_names=["f1"], pooling=torchrec.PoolingType.MEAN)]


def _batch(step: int, device: str):
    """(dense features, sparse features, labels); some bags are empty. A fresh KJT per device:
    ``KeyedJaggedTensor.to`` carries its cached per-key split over unmoved."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=values.to(device), lengths=lengths.to(device))
    dense = torch.randn(BATCH, 4, generator=g).to(device)
    return dense, kjt, torch.randint(0, 2, (BATCH,), generator=g).float().to(device)


@pytest.mark.parametrize("name", ["complete", "exclusive", "inclusive"])
def test_fbgemm_cumsum_equals_cpu(name):
    op = getattr(torch.ops.fbgemm, f"asynchronous_{name}_cumsum")
    for x in [torch.tensor([2, 0, 3, 1]), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)]:
        expected = op(x)
        got = op(x.to("tpu"))
        assert got.device.type == "tpu" and got.dtype == expected.dtype
        assert torch.equal(got.cpu(), expected)


def test_embedding_bag_collection_forward_backward_equals_cpu():
    cpu = torchrec.EmbeddingBagCollection(tables=_tables(), device=torch.device("cpu"))
    dev = torchrec.EmbeddingBagCollection(tables=_tables(), device=torch.device("tpu"))
    dev.load_state_dict(cpu.state_dict())
    outputs = []
    for model, device in [(cpu, "cpu"), (dev, "tpu")]:
        _, kjt, _ = _batch(0, device)
        assert kjt.offsets().device.type == device
        pooled = model(kjt)
        assert pooled.keys() == KEYS and pooled.values().device.type == device
        (pooled.values() * torch.arange(2 * DIM, device=device)).sum().backward()
        outputs.append((pooled.to_dict(), [p.grad for p in model.parameters()]))
    (expected, expected_grads), (got, got_grads) = outputs
    for key in KEYS:
        torch.testing.assert_close(got[key].cpu(), expected[key])
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g.cpu(), e)


def _train_dlrm(device: str, steps: int = 3):
    torch.manual_seed(0)
    model = DLRM(
        embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=_tables()),
        dense_in_features=4, dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[8, 1],
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(steps):
        dense, kjt, labels = _batch(step, device)
        logits = model(dense, kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_dlrm_trains_equal_to_cpu():
    expected, expected_state = _train_dlrm("cpu")
    got, state = _train_dlrm("tpu")
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert expected[-1] != expected[0]  # the steps changed the model
    for name, value in expected_state.items():
        torch.testing.assert_close(state[name].cpu(), value, msg=name)
