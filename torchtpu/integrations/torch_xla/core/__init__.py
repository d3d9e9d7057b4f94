"""``torch_xla.core``: ``xla_model`` (``xm``)."""
