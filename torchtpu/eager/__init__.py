"""The executors: Strict, Debug and DeferAndFuse, and the PrivateUse1 dispatch entry into them.

Its modules import one another in a cycle (meta -> refusals -> at_call -> executor -> program ->
meta) that resolves only when ``dispatch`` is imported first, as registration does; so this
package imports it first, whichever of its modules a program or a test imports first (``import
torch`` no longer imports them all in that order: the device loads at its first op).
"""

from torchtpu.eager import dispatch  # noqa: F401
