"""``torch_xla.distributed``: ``parallel_loader`` (``pl``), ``xla_multiprocessing`` (``xmp``),
``spmd`` (``xs``)."""
