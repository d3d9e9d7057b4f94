"""torch.export programs as JAX artifacts that run without torch (``save``, ``load``), and as
StableHLO text (``stablehlo``).

``program`` turns an ExportedProgram into one pure JAX function from the lowering table the
compiled path uses; ``shapes`` maps its ``torch.export.Dim``s to JAX symbolic dimensions;
``save`` exports, serializes and writes the artifact. The loader is ``torchtpu_artifact``, a
top-level module that imports only JAX and NumPy (``torchtpu.export.load`` is the same function,
for processes that have torch anyway).
"""

from torchtpu.export.save import save, stablehlo
from torchtpu_artifact import Program, load

__all__ = ["Program", "load", "save", "stablehlo"]
