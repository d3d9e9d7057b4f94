"""``torch_xla.debug``: ``metrics`` (``met``)."""
