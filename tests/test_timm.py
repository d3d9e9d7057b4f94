"""timm image models on tpu: ResNet-50, ViT and ConvNeXt built with ``timm.create_model`` (small
widths, random weights, ``pretrained=False``: nothing is downloaded) run a forward pass and one
training step, eagerly and under ``torch.compile(backend="tpu")``, to CPU's logits, loss, weights
and batch-norm statistics.

timm imports torchvision, and PyPI's torchvision loads only beside the torch it was built for:
these tests need the ``timm`` extra in a venv of its own with torch 2.14.1 and torchvision 0.29.1
(docs, timm), and skip elsewhere, the dev venv (torch 2.13.0) included."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

try:
    import timm
    import timm.optim
except Exception as e:  # torchvision built for another torch raises RuntimeError, not ImportError
    pytest.skip(f"needs timm and torchvision (torch 2.14.1 + torchvision 0.29.1 in a venv of its "
                f"own, docs: timm): {type(e).__name__}: {e}", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

# The reference's tolerances for image models; cosine similarity of the flattened logits.
TOL = dict(atol=1e-3, rtol=1e-3)
MIN_COSINE = 0.99999
# Each architecture at its real depth (ResNet-50's [3, 4, 6, 3] bottlenecks, ConvNeXt's four
# stages), with narrow channels and 32x32 images so that a step compiles in seconds.
MODELS = {
    "resnet50": dict(channels=(8, 16, 32, 64), stem_width=8),
    "vit_tiny_patch16_224": dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
    "convnext_atto": dict(depths=(1, 1, 1, 1), dims=(8, 16, 32, 64)),
}
CLASSES, BATCH = 10, 4


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=CLASSES, **MODELS[name])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 3, 32, 32, generator=gen),
            torch.randint(0, CLASSES, (BATCH,), generator=gen))


def _train_step(model: torch.nn.Module, device: str, compiled: bool) -> dict:
    """Training-mode logits and loss, one SGD step from timm's optimizer factory, then eval-mode
    logits with the new weights; the state dict after the step (weights, BN running stats)."""
    run = torch.compile(model, backend="tpu") if compiled else model
    opt = timm.optim.create_optimizer_v2(model, "sgd", lr=0.1, momentum=0.9, weight_decay=1e-4)
    images, labels = (t.to(device) for t in _batch())
    model.train()
    logits = run(images)
    loss = F.cross_entropy(logits, labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
    model.eval()
    with torch.no_grad():
        after = run(images)
    return {"logits": logits.detach().cpu(), "loss": loss.detach().cpu(), "after": after.cpu(),
            "state": {k: v.cpu() for k, v in model.state_dict().items()}}


@functools.cache
def _cpu_reference(name: str) -> dict:
    return _train_step(_model(name), "cpu", compiled=False)


def _assert_logits_match(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOL)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))
    cosine = F.cosine_similarity(actual.flatten(), expected.flatten(), dim=0).item()
    assert cosine > MIN_COSINE, f"cosine similarity {cosine} <= {MIN_COSINE}"


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", list(MODELS))
def test_forward_and_training_step_match_cpu(name, compiled):
    expected = _cpu_reference(name)
    model = copy.deepcopy(_model(name)).to("tpu")
    assert next(model.parameters()).device.type == "tpu"
    got = _train_step(model, "tpu", compiled)
    _assert_logits_match(got["logits"], expected["logits"])
    torch.testing.assert_close(got["loss"], expected["loss"], **TOL)
    _assert_logits_match(got["after"], expected["after"])
    torch.testing.assert_close(got["state"], expected["state"], **TOL)
