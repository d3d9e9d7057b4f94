"""Tiny Hugging Face checkpoints made from configs, for serving tests and benchmarks (no hub).

:func:`save_tiny_model` writes a randomly initialised Llama or Qwen2 with a byte-level tokenizer
(every UTF-8 byte is a token, so any text encodes) and a chat template to a directory that
``vllm.LLM(model=dir)``, ``vllm serve dir`` and ``transformers.AutoModelForCausalLM`` all load.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ("<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def byte_tokenizer():
    """The byte-level tokenizer (every UTF-8 byte a token, ``<s>`` and ``</s>``), chat template
    included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for name in SPECIALS:
        vocab[name] = len(vocab)
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>")
    tok.add_special_tokens({"additional_special_tokens": []})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tiny_model(path: str | Path, arch: str = "llama", *, hidden: int = 128, layers: int = 2,
                    heads: int = 2, kv_heads: int = 1, seed: int = 0,
                    max_positions: int = 512) -> Path:
    """Write a tiny ``arch`` ("llama" or "qwen2") checkpoint and tokenizer to ``path``."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config}
    if arch not in configs:
        raise ValueError(f"torchtpu.argument: arch={arch!r} is not one of {sorted(configs)}")
    tok = byte_tokenizer()
    config = configs[arch](
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False, torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # random weights give near-uniform logits, where greedy picks hang on rounding; larger
    # output weights make the argmax clear, so token equality checks what it should
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    path = Path(path)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
