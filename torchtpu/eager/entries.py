"""The kinds of a call spec's entries, one per bound argument (``program.Spec.entries``).

A leaf module: ``program`` builds specs of these kinds and ``lazy_casts`` reads a held call's
entries, and ``program`` imports ``lazy_casts``.
"""

TENSOR = "t"       # one array; payload: None, or how to read it: a view Geometry or a
                   # lazy cast's ``Cast``
TENSORS = "l"      # a list of arrays/None: payload, per element: True (None), False (an
                   # array) or how to read the array (a Geometry or a ``Cast``)
SCALAR = "s"       # a traced Python number
KEY = "k"          # PRNG key data -> a JAX key
CONST = "c"        # baked-in constant: payload is the value
