"""bench/paged_sweep.py (the paged kernel's decode sweep for the chip) at tiny sizes on CPU, through
torchtpu's XLA form of the kernel's attention (``--dense``; JAX's kernel runs in neither of JAX's
interpreters): every page size reads the same logical keys and values back through its shuffled
pages and block table, so every row's output is the first row's, and the roofline figures are
the context's bytes."""

from __future__ import annotations

import os
import sys

BENCH = os.path.join(os.path.dirname(__file__), os.pardir, "bench")


def test_every_page_size_reads_the_same_attention(tmp_path):
    sys.path.insert(0, BENCH)
    try:
        import paged_sweep
    finally:
        sys.path.remove(BENCH)
    rows = paged_sweep.main(["--dense", "--batch", "3", "--context", "40", "--layers", "1",
                             "--runs", "1", "--budget", "600"])
    # pages of 16-128 at a max_model_len of 128, then queries 1-32 at pages of 64
    assert [(r["page"], r["kv_pages_per_block"], r["queries"]) for r in rows] == [
        (16, 8, 8), (32, 4, 8), (64, 2, 8), (128, 1, 8),
        (64, 2, 1), (64, 2, 4), (64, 2, 16), (64, 2, 32)]
    assert all("error" not in r and r["max_diff"] == 0.0 for r in rows), rows
    # 3 sequences x 40 tokens x one combined head's keys and values (2 x 128 bf16)
    assert rows[0]["kv_mb_needed"] == 3 * 40 * 512 / 1e6
    assert rows[0]["kv_mb_copied"] == 3 * 128 * 512 / 1e6  # a whole block of 128 tokens each
