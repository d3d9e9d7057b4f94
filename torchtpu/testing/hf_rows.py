"""The benchmark registry's Hugging Face rows: small Llama-3.2, Gemma-3 and Qwen3 configs.

Built from configs with random weights (seeded, on CPU; no hub), each family's distinguishing
features kept at small sizes: Llama-3.2's tied head and llama3 RoPE scaling, Gemma-3's
sliding/full attention layers and head_dim, Qwen3's q/k norms. ``bench/registry.py`` times them;
``bench/checkpoint_memory.py``, ``bench/compile_depth.py`` and tests build the same models here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HF_VOCAB, HF_SEQ, HF_BATCH = 256, 32, 4
_HF_COMMON = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, attn_implementation="sdpa")
HF_CONFIGS = {
    "llama-3.2": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))),
    "gemma-3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=16,
                                         layer_types=["sliding_attention", "full_attention"])),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
}


def hf(name: str, **overrides) -> Callable[[], torch.nn.Module]:
    """A builder of HF_CONFIGS[name]'s causal LM (seeded), with config fields overridden."""
    if name not in HF_CONFIGS:
        raise ValueError(f"torchtpu.argument: no Hugging Face row {name!r}: the rows are "
                         f"{sorted(HF_CONFIGS)}")

    def build() -> torch.nn.Module:
        import transformers
        config_class, extra = HF_CONFIGS[name]
        torch.manual_seed(0)
        config = getattr(transformers, config_class)(**{**_HF_COMMON, **extra, **overrides})
        return transformers.AutoModelForCausalLM.from_config(config)
    return build


def tokens(vocab: int, seq: int, batch: int) -> Callable[[torch.Generator], tuple]:
    """A drawer of (input, next-token target) batches of token ids on CPU."""
    def draw(gen: torch.Generator) -> tuple:
        x = torch.randint(vocab, (batch, seq + 1), generator=gen)
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()
    return draw
