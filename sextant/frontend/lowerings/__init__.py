"""ATen → graph-IR lowerings, one module per op family. Importing this package fills the table."""

from sextant.frontend.lowerings import (  # noqa: F401
    attention,
    backward,
    collectives,
    elementwise,
    moe,
    movement,
    nn,
    random,
    reductions,
    resample,
    scatter,
    sizes,
    strided,
)
from sextant.frontend.lowerings.attention import KEPT_WHOLE
from sextant.frontend.lowerings.registry import (
    LOWERINGS,
    LoweringContext,
    NoNativeForm,
    Unsupported,
    lower,
    lowering_for,
)

__all__ = ["KEPT_WHOLE", "LOWERINGS", "LoweringContext", "NoNativeForm", "Unsupported", "lower", "lowering_for"]
