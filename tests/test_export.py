"""torchtpu.export: torch.export programs saved as JAX artifacts and run where torch is not.

One small TinyGPT is exported once with a dynamic batch and sequence (module fixture); a child
process that cannot import torch (a meta-path blocker) loads the artifact with the loader copied
into it and runs it at two sizes, under jax.jit and sharded over two CPU devices; the outputs are
compared with the module on CPU. The registry and Hugging Face models are full-suite rows.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.export import Dim

import torchtpu.export as tx
from torchtpu.testing.models import TinyGPT

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")

ROOT = Path(__file__).resolve().parents[1]
VOCAB, BLOCK = 48, 32
SIZES = [(2, 16), (3, 7)]  # (batch, seq): one artifact, two shapes

# Runs in the child: torch and torchtpu cannot be imported; the artifact's own loader copy is.
CHILD = r"""
import importlib.abc, json, sys
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torchtpu"):
            raise ImportError("blocked in this process: " + name)
sys.meta_path.insert(0, Blocker())
directory, inputs, out = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, directory)
import numpy as np, jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import torchtpu_artifact
assert torchtpu_artifact.__file__.startswith(directory), torchtpu_artifact.__file__
program = torchtpu_artifact.load(directory)
given = dict(np.load(inputs))
results = {}
for name, x in given.items():
    results["eager_" + name] = np.asarray(program(x))
    results["jit_" + name] = np.asarray(jax.jit(program.call)(program.weights, x)[0])
mesh = Mesh(np.array(jax.devices()[:2]), ("b",))
x = given["sharded"]
placed = jax.device_put(x, NamedSharding(mesh, P("b")))
y = jax.jit(program)(placed)
results["placed_devices"] = np.asarray(len(y.sharding.device_set))
np.savez(out, **results)
print(json.dumps({"torch_loaded": "torch" in sys.modules}))
"""


def _tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, BLOCK, n_layer=1, n_head=2, n_embd=16).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = _tiny_gpt()
    x = torch.randint(VOCAB, (2, 16))
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: Dim("batch"),
                                                           1: Dim("seq", max=BLOCK)},))
    directory = tx.save(ep, tmp_path_factory.mktemp("tinygpt"))
    return model, Path(directory)


def run_torch_free(directory: Path, inputs: dict, tmp_path: Path) -> dict:
    """The child's results for inputs (name -> int64 array), run without torch."""
    np.savez(tmp_path / "inputs.npz", **inputs)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(directory),
                           str(tmp_path / "inputs.npz"), str(tmp_path / "out.npz")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"torch_loaded": False}
    return dict(np.load(tmp_path / "out.npz"))


def test_artifact_runs_without_torch_at_two_sizes_jitted_and_sharded(saved, tmp_path):
    model, directory = saved
    g = torch.Generator().manual_seed(1)
    inputs = {f"{b}x{s}": torch.randint(VOCAB, (b, s), generator=g) for b, s in SIZES}
    inputs["sharded"] = torch.randint(VOCAB, (4, 9), generator=g)
    results = run_torch_free(directory, {k: v.numpy() for k, v in inputs.items()}, tmp_path)
    with torch.no_grad():
        for name, x in inputs.items():
            expected = model(x)[0].numpy()
            if name == "sharded":
                continue
            for form in ("eager", "jit"):
                got = results[f"{form}_{name}"]
                assert got.shape == expected.shape
                np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert int(results["placed_devices"]) == 2


def test_manifest_names_weights_inputs_and_symbols(saved):
    model, directory = saved
    manifest = json.loads((directory / "manifest.json").read_text())
    weights = [i["name"] for i in manifest["inputs"] if i["kind"] == "parameter"]
    assert weights == [n for n, _ in model.named_parameters(remove_duplicate=False)]
    (user,) = [i for i in manifest["inputs"] if i["kind"] == "user_input"]
    assert user == {"name": "idx", "kind": "user_input", "dtype": "int64",
                    "shape": ["idx_0", "idx_1"]}
    assert manifest["symbols"] == {"idx_0": {"min": 1, "max": None},
                                   "idx_1": {"min": 1, "max": BLOCK}}
    (out,) = manifest["outputs"]
    assert out["shape"] == ["idx_0", "idx_1", VOCAB] and out["dtype"] == "float32"
    from torchtpu_artifact import read_safetensors
    stored = read_safetensors(str(directory / "weights.safetensors"))
    for name, p in model.named_parameters():
        np.testing.assert_array_equal(stored[name], p.detach().numpy())


@pytest.mark.parametrize("x, words", [
    (np.zeros((2, 3, 4), np.int64), ["'idx'", "rank 3", "int64[idx_0, idx_1]"]),
    (np.zeros((2, 3), np.int32), ["'idx'", "dtype int32", "int64[idx_0, idx_1]"]),
    (np.zeros((2, BLOCK + 1), np.int64), ["'idx'", "dimension 1", "idx_1's range [1, 32]"]),
])
def test_wrong_inputs_name_the_input_and_the_symbolic_shape(saved, x, words):
    program = tx.load(saved[1])
    with pytest.raises((ValueError, TypeError)) as e:
        program(x)
    assert str(e.value).startswith("torchtpu.export: ")
    for w in words:
        assert w in str(e.value)


class _Norm(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 5)
        self.bn = torch.nn.BatchNorm1d(5)

    def forward(self, x):
        return self.bn(self.lin(x)).relu()


def test_buffer_updates_come_back_as_outputs(tmp_path):
    model = _Norm().train()
    x = torch.randn(7, 6)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: Dim("n", min=2)},))
    program = tx.load(tx.save(ep, tmp_path / "bn"))
    x2 = torch.randn(9, 6)
    outputs, buffers = program.call(program.weights, x2.numpy())
    expected = model(x2)  # updates the module's statistics, as the program's outputs
    np.testing.assert_allclose(np.asarray(outputs), expected.detach().numpy(), atol=1e-5)
    assert sorted(buffers) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    for name in buffers:
        np.testing.assert_allclose(np.asarray(buffers[name]),
                                   model.get_buffer(name).numpy(), atol=1e-6)
    assert program.symbols == {"x_0": {"min": 2, "max": None}}


def test_stablehlo_text_is_shape_polymorphic():
    model = _Norm().eval()
    ep = torch.export.export(model, (torch.randn(3, 6),), dynamic_shapes=({0: Dim("n")},))
    text = tx.stablehlo(ep)
    assert "func.func public @main" in text and "stablehlo.dot_general" in text
    assert "tensor<?x6xf32>" in text  # the dynamic batch


@torch.library.custom_op("torchtpu_export_test::unlowered", mutates_args=())
def _unlowered(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_unlowered.register_fake
def _(x):
    return torch.empty_like(x)


class _Inner(torch.nn.Module):
    def forward(self, x):
        return _unlowered(x) + 1


class _Outer(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x * 2)


class _Nonzero(torch.nn.Module):
    def forward(self, x):
        return x.nonzero()


def test_op_without_lowering_names_the_op_and_the_module(tmp_path):
    ep = torch.export.export(_Outer(_Inner()), (torch.randn(3),))
    with pytest.raises(NotImplementedError, match=r"torchtpu.export: aten op "
                       r"'torchtpu_export_test.unlowered.default' \(called in module 'inner' "
                       r"\(_Inner\)\) has no tpu lowering"):
        tx.save(ep, tmp_path / "x")


def test_data_dependent_shape_names_the_op_and_what_to_do(tmp_path):
    ep = torch.export.export(_Outer(_Nonzero()), (torch.randn(4),))
    with pytest.raises(NotImplementedError) as e:
        tx.save(ep, tmp_path / "x")
    text = str(e.value)
    assert text.startswith("torchtpu.export: 'aten.nonzero.default' (called in module 'inner'")
    assert "data-dependent shape" in text and "torch.nonzero_static" in text
