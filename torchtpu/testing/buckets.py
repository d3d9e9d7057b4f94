"""Eager size buckets as a fresh process has them, for tests that count what growing calls make:
the sizes an earlier test's sites took, and the calls it ran exact, would change which calls
look at their sites and which run padded."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torchtpu.compile import call_sites, eager_buckets


@contextlib.contextmanager
def fresh_buckets() -> Iterator[None]:
    """Buckets on (also where ``TORCHTPU_EAGER_BUCKETS=0``), every site's sizes and every exact
    call forgotten before and after the block."""
    call_sites.clear()
    eager_buckets._exact.clear()
    was = eager_buckets.enabled()
    eager_buckets.set_enabled(True)
    try:
        yield
    finally:
        eager_buckets.set_enabled(was)
        call_sites.clear()
        eager_buckets._exact.clear()
