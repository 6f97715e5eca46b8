"""Range analysis of kernel IR, in one import: the names of its modules that other code uses.

* :mod:`sextant.kernel.intervals` — interval arithmetic per node (sound, never across a wrap);
* :mod:`sextant.kernel.facts` — :class:`Env` (the facts at one point), :func:`bounds`, and what
  a condition adds (:func:`refine`, :func:`assume`);
* :mod:`sextant.kernel.flow` — :class:`Ranges`: facts through statements, loops and branches,
  and each register's range over the kernel (:func:`register_ranges`);
* :mod:`sextant.kernel.evaluate` — the concrete counterpart (:func:`eval_expr`);
* :mod:`sextant.kernel.exprs` — operands, registers read and written.
"""

from sextant.kernel.evaluate import (
    Compiled,
    EvalError,
    Undefined,
    Unknown,
    Value,
    cast_value,
    compile_expr,
    eval_expr,
    int_binary,
    int_unary,
)
from sextant.kernel.exprs import assigned_names, children, contains_load, free_names
from sextant.kernel.facts import Env, Facts, assume, bounds, refine
from sextant.kernel.flow import Ranges, loop_range, register_ranges, special_ranges
from sextant.kernel.intervals import (
    CMP_NEGATE,
    CMP_SWAP,
    Interval,
    hull,
    int_range,
    intersect,
    is_intlike,
    tdiv,
    tmod,
    wrap,
)

__all__ = [
    "CMP_NEGATE", "CMP_SWAP", "Compiled", "Env", "EvalError", "Facts", "Interval", "Ranges", "Undefined",
    "Unknown", "Value", "assigned_names", "assume", "bounds", "cast_value", "children", "compile_expr",
    "contains_load", "eval_expr", "free_names", "hull", "int_binary", "int_range", "int_unary", "intersect",
    "is_intlike", "loop_range", "refine", "register_ranges", "special_ranges", "tdiv", "tmod", "wrap",
]
