"""The demo: ``python -m torchtpu.demo`` trains a character-level GPT on a short story on "tpu"."""
