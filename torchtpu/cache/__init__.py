"""The cache room: programs kept across processes.

It owns the persistent compile cache (``compile_cache.py``: JAX's executables stored as checked
entries, with ``cache_entry.py``, ``cache_writer.py``, ``cache_faults.py``, the offline check
``cache_check.py`` and the per-process policy ``cache_policy.py``), the room XLA's executables
need in the memory maps (``map_room.py``), and warm starts: programs found by torchtpu's own key
without tracing (``warm.py``, ``warm_keys.py``, ``warm_dispatch.py``) and loaded ahead of use
(``warm_ahead.py``), with the records kept beside them.

It imports the runtime room (``torchtpu.runtime``) only, never ``torchtpu.targets``; it plugs
into the runtime through ``runtime/hooks.py`` (the cache starts with the platform, and keeps the
records).
"""
