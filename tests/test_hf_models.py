"""Tiny random Hugging Face Transformers models on tpu: logits, gradients and greedy generate().

Models are built from configs (no hub access), moved to tpu the way users do (``.to("tpu")``)
and compared with the same model on CPU.
"""

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from torchtpu.testing.compare import assert_same  # noqa: E402

VOCAB = 100
TOL = dict(atol=1e-4, rtol=1e-4)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa"))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        attn_implementation="sdpa"))


def bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa"))


def t5():
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


MODELS = {"llama": llama, "gpt2": gpt2, "bert": bert, "t5": t5}
GENERATES = ("llama", "gpt2", "t5")


def inputs(name: str) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, VOCAB, (2, 8), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if name == "t5":
        batch["labels"] = torch.randint(2, VOCAB, (2, 5), generator=g)
    else:
        batch["labels"] = ids
    return batch


def on_tpu(batch: dict) -> dict:
    return {k: v.to("tpu") for k, v in batch.items()}


@pytest.fixture(params=list(MODELS))
def pair(request):
    torch.manual_seed(0)
    cpu = MODELS[request.param]().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    return request.param, cpu, tpu


# Every eager mode must give the same numbers (issue: Strict, Debug, DeferAndFuse parity).
MODES = list(torch.tpu.EagerMode)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_forward_and_backward_match_cpu(pair, mode):
    name, cpu, tpu = pair
    batch = inputs(name)
    expected = cpu(**batch)
    expected.loss.backward()
    with torch.tpu.set_eager_mode(mode):
        actual = tpu(**on_tpu(batch))
        actual.loss.backward()
    assert_same(actual.logits, expected.logits, **TOL)
    assert_same(actual.loss, expected.loss, **TOL)
    cpu_params = dict(cpu.named_parameters())
    grads = {n: p.grad for n, p in tpu.named_parameters()}
    assert all(g is not None and g.device.type == "tpu" for g in grads.values())
    # Every gradient, tied input/output embeddings included.
    assert_same(grads, {n: cpu_params[n].grad for n in grads}, **TOL)

# Llama's greedy tokens in Strict (the slowest pair, ~30 s on CI's box) run in the full stage;
# Strict's generate runs here for GPT-2 and T5, and Llama's in the other modes.
@pytest.mark.parametrize(("name", "mode"), [
    pytest.param(n, m, id=f"{n}-{m.name}", marks=[pytest.mark.full] * (
        (n, m) == ("llama", torch.tpu.EagerMode.DEFER_NEVER)))
    for n in GENERATES for m in MODES])
def test_greedy_generate_matches_cpu(name, mode):
    torch.manual_seed(0)
    cpu = MODELS[name]().eval()
    tpu = copy.deepcopy(cpu).to("tpu")
    batch = inputs(name)
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    expected = cpu.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    with torch.tpu.set_eager_mode(mode):
        actual = tpu.generate(batch["input_ids"].to("tpu"),
                              attention_mask=batch["attention_mask"].to("tpu"), **kwargs)
    assert actual.device.type == "tpu"
    assert_same(actual, expected, atol=0, rtol=0)
