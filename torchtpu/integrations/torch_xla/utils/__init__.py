"""``torch_xla.utils``: ``utils`` (``xu``)."""
