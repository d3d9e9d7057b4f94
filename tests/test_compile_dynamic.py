"""``torch.compile(dynamic=True)``: graphs that mix positions along a symbolic dim run padded to
size buckets with masks, and still match CPU exactly.

A graph's first call runs at its exact sizes; from then on, each symbol that has varied is padded
to its bucket (one program per bucket) and the others keep their size."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.demo.gpt import TinyGPT
from torchtpu.testing.compare import assert_same

OPTIONS = {"bucket_size": 16, "num_dynamic_buckets": 2}


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _count(name: str) -> int:
    return torchtpu.metrics.snapshot().get(name, 0)


def _gpt() -> tuple[TinyGPT, TinyGPT]:
    torch.manual_seed(0)
    cpu = TinyGPT(vocab=50, block=64, n_layer=1, n_head=2, n_embd=32)
    return cpu, copy.deepcopy(cpu).to("tpu")


def test_tinygpt_inference_compiles_once_per_bucket():
    cpu, dev = _gpt()
    cpu.eval()
    compiled = torch.compile(dev.eval(), backend="tpu", dynamic=True, options=OPTIONS)
    programs, exact = _count("compiled_graphs"), _count("dynamic_exact_shape_compiles")
    with torch.no_grad():
        for t in (5, 9, 13, 16, 20, 31):  # buckets 16 and 32
            idx = torch.randint(50, (2, t))
            logits, _ = compiled(idx.to("tpu"))
            assert_same(logits, cpu(idx)[0], atol=1e-5, rtol=1e-5)
    assert _count("compiled_graphs") - programs <= 3  # the first call's sizes, then 2 buckets
    assert _count("dynamic_exact_shape_compiles") == exact


def test_only_sizes_that_vary_are_padded():
    texts = []
    options = {**OPTIONS, "debug_callback": lambda gm, hlo: texts.append(hlo)}
    compiled = torch.compile(lambda x: x.softmax(1) * x.shape[1], backend="tpu", dynamic=True,
                             options=options)
    for t in (5, 9, 13):
        x = torch.randn(3, t)
        assert_same(compiled(x.to("tpu")), x.softmax(1) * t, atol=1e-6, rtol=1e-6)
    assert len(texts) == 2
    assert "tensor<3x5xf32>" in texts[0]  # the first call: its own sizes
    assert "tensor<3x16xf32>" in texts[1] and "x5xf32>" not in texts[1]  # the batch of 3 stays


def test_tinygpt_loss_over_merged_batch_and_sequence_one_program_per_bucket():
    # The loss views logits [B, s, V] as [B*s, V]: the mean cross entropy reduces a merged dim.
    cpu, dev = _gpt()
    cpu.eval()
    compiled = torch.compile(dev.eval(), backend="tpu", dynamic=True, options=OPTIONS)
    programs = _count("compiled_graphs")
    with torch.no_grad():
        for t in (6, 11, 14):
            idx, targets = torch.randint(50, (3, t)), torch.randint(50, (3, t))
            assert_same(compiled(idx.to("tpu"), targets.to("tpu")), cpu(idx, targets),
                        atol=1e-5, rtol=1e-5)
    assert _count("compiled_graphs") - programs == 2  # the first call's sizes, then bucket 16


def test_tinygpt_training_gradients_run_padded():
    cpu, dev = _gpt()
    compiled = torch.compile(dev, backend="tpu", dynamic=True, options=OPTIONS)
    programs, exact = _count("compiled_graphs"), _count("dynamic_exact_shape_compiles")
    for t in (7, 12, 15):
        idx, targets = torch.randint(50, (2, t)), torch.randint(50, (2, t))
        _, loss = compiled(idx.to("tpu"), targets.to("tpu"))
        loss.backward()
        _, expected = cpu(idx, targets)
        expected.backward()
        assert_same(loss, expected, atol=1e-5, rtol=1e-5)
    # Forward and backward, each at the first call's sizes, then at bucket 16.
    assert _count("compiled_graphs") - programs == 4
    assert _count("dynamic_exact_shape_compiles") == exact
    for (name, p), q in zip(cpu.named_parameters(), dev.parameters(), strict=True):
        assert_same(q.grad, p.grad, atol=1e-5, rtol=1e-4), name


def _nan_in_padding(x):
    y = x * torch.log(x)  # 0 * -inf: NaN wherever x is zero, as in padding
    return (y.sum(1), y.mean(1), y.amax(1), torch.softmax(y, 1), y.reshape(-1).mean(),
            y @ y.transpose(0, 1) * y.shape[1])


def test_nan_in_padding_never_leaks():
    compiled = torch.compile(_nan_in_padding, backend="tpu", dynamic=True, options=OPTIONS)
    programs, exact = _count("compiled_graphs"), _count("dynamic_exact_shape_compiles")
    # Five sizes, four of them in bucket 16: one program per size (no padding at all, so no
    # NaN to leak) would be 5 programs.
    for t in (3, 5, 10, 12, 14):
        x = torch.rand(4, t) + 0.1
        out = compiled(x.to("tpu"))
        assert_same(out, _nan_in_padding(x), atol=1e-5, rtol=1e-5)
    assert _count("dynamic_exact_shape_compiles") == exact
    assert _count("compiled_graphs") - programs <= 3  # t=3 may be traced before t is a symbol


def test_reduction_that_cannot_be_masked_falls_back_to_exact_shapes():
    def fn(x):
        return F.gelu(x).std(dim=1) * x.sum(1)

    compiled = torch.compile(fn, backend="tpu", dynamic=True, options=OPTIONS)
    before = _count("dynamic_exact_shape_compiles")
    for t in (4, 6, 9):
        x = torch.randn(3, t)
        assert_same(compiled(x.to("tpu")), fn(x), atol=1e-5, rtol=1e-5)
    assert _count("dynamic_exact_shape_compiles") - before >= 2


@pytest.mark.parametrize("bool_mask", [True, False], ids=["bool", "additive"])
def test_attention_with_a_padding_mask_runs_padded(bool_mask):
    # An encoder's attention: not causal, keys masked by a per-sequence padding mask.
    def attend(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    compiled = torch.compile(attend, backend="tpu", dynamic=True, options=OPTIONS)
    programs, exact = _count("compiled_graphs"), _count("dynamic_exact_shape_compiles")
    for t in (5, 9, 12):
        q, k, v = (torch.randn(2, 2, t, 8, requires_grad=True) for _ in range(3))
        keep = torch.rand(2, 1, 1, t) > 0.3
        keep[..., 0] = True
        mask = keep if bool_mask else torch.where(keep, 0.0, -1e9).requires_grad_()
        inputs = [q, k, v, mask]
        dev = [x.detach().to("tpu").requires_grad_(x.requires_grad) for x in inputs]
        out = compiled(*dev)
        out.square().sum().backward()
        expected = attend(*inputs)
        expected.square().sum().backward()
        assert_same(out, expected, atol=1e-5, rtol=1e-5)
        for d, c in zip(dev, inputs, strict=True):
            if c.requires_grad:
                assert_same(d.grad, c.grad, atol=1e-5, rtol=1e-4)
    assert _count("dynamic_exact_shape_compiles") == exact
    # Forward and backward at the first call's sizes, then at bucket 16.
    assert _count("compiled_graphs") - programs == 4


def _reads(x, positions):
    # gather and integer-tensor indexing along the padded dim, a select from its start.
    table = torch.arange(64.0, device=x.device).reshape(2, 32)
    return (x.gather(1, positions) * 2, table[:, positions[0]] + x[:, :1], x[:, 0] + 1)


def test_gather_index_and_select_from_the_start_run_padded():
    compiled = torch.compile(_reads, backend="tpu", dynamic=True, options=OPTIONS)
    programs, exact = _count("compiled_graphs"), _count("dynamic_exact_shape_compiles")
    for t in (5, 9, 12):
        x, positions = torch.randn(2, t), torch.randint(t, (2, t))
        dev = compiled(x.to("tpu"), positions.to("tpu"))
        assert_same(dev, _reads(x, positions))
    assert _count("dynamic_exact_shape_compiles") == exact
    assert _count("compiled_graphs") - programs == 2


def _last(x):
    # An LM's next-token logits (x[:, -1]) and a trailing window, counted from the real end.
    return x[:, -1] * 2, x[:, -3:] + 1


def test_positions_counted_from_the_end_run_padded():
    compiled = torch.compile(_last, backend="tpu", dynamic=True, options=OPTIONS)
    programs, exact = _count("compiled_graphs"), _count("dynamic_exact_shape_compiles")
    for t in (5, 9, 12):
        x = torch.randn(2, t, 4)
        assert_same(compiled(x.to("tpu")), _last(x))
    assert _count("dynamic_exact_shape_compiles") == exact
    assert _count("compiled_graphs") - programs == 2


def _runs_padded(cpu, inputs_at, outputs: tuple) -> None:
    """cpu's model compiled with dynamic=True matches it at 4 lengths with 2 programs."""
    compiled = torch.compile(copy.deepcopy(cpu).to("tpu"), backend="tpu", dynamic=True,
                             options=OPTIONS)
    programs, exact = _count("compiled_graphs"), _count("dynamic_exact_shape_compiles")
    with torch.no_grad():
        for t in (5, 9, 12, 14):
            inputs = inputs_at(t)
            out = compiled(**{k: v.to("tpu") for k, v in inputs.items()})
            expected = cpu(**inputs)
            for name in outputs:
                assert_same(getattr(out, name), getattr(expected, name), atol=1e-5, rtol=1e-5)
    assert _count("dynamic_exact_shape_compiles") == exact
    assert _count("compiled_graphs") - programs == 2  # the first call's sizes, then bucket 16


def _gpt2_config(**extra):
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=1, n_head=2,
                                   n_positions=64, attn_implementation="sdpa",
                                   bos_token_id=0, eos_token_id=0, **extra)


def test_hugging_face_bert_with_padding_masks_runs_padded():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, attn_implementation="sdpa")

    def inputs_at(t):
        mask = torch.ones(2, t, dtype=torch.long)
        mask[1, t // 2:] = 0
        return {"input_ids": torch.randint(50, (2, t)), "attention_mask": mask}

    _runs_padded(transformers.BertModel(config).eval(), inputs_at,
                 ("last_hidden_state", "pooler_output"))


def test_hugging_face_gpt2_runs_padded():
    # Its graph also holds ops Dynamo adds after decomposition (true_divide, convert_element_type
    # from symbolic float arithmetic turned into tensor ops).
    transformers = pytest.importorskip("transformers")
    _runs_padded(transformers.GPT2LMHeadModel(_gpt2_config()).eval(),
                 lambda t: {"input_ids": torch.randint(50, (2, t))}, ("logits",))


def test_hugging_face_gpt2_training_stays_right():
    # Its training graphs use negated sizes and shift the labels by padding the sequence dim
    # (not exact under padding: compiled per shape); the gradients must still match CPU.
    transformers = pytest.importorskip("transformers")
    config = _gpt2_config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cpu = transformers.GPT2LMHeadModel(config).train()
    dev = copy.deepcopy(cpu).to("tpu")
    compiled = torch.compile(dev, backend="tpu", dynamic=True, options=OPTIONS)
    for t in (5, 9):
        ids = torch.randint(50, (2, t))
        loss = compiled(input_ids=ids.to("tpu"), labels=ids.to("tpu")).loss
        loss.backward()
        expected = cpu(input_ids=ids, labels=ids).loss
        expected.backward()
        assert_same(loss, expected, atol=1e-5, rtol=1e-5)
        for p, q in zip(dev.parameters(), cpu.parameters(), strict=True):
            assert_same(p.grad, q.grad, atol=1e-5, rtol=1e-4)
            p.grad = q.grad = None
