"""The executors: Strict, Debug and DeferAndFuse, and the PrivateUse1 dispatch entry into them.

Its modules import one another without a circle (``tests/test_import_graph.py``), so any of them
can be imported first; ``registration`` loads ``dispatch`` and with it the rest at the device's
first op.
"""
