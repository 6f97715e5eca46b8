"""Graph-to-graph passes (random-op expansion, simplify, constant folding, CSE, DCE, in-place
updates) and the pipeline that runs them."""

from sextant.graph.passes.pipeline import (
    FINALLY,
    FIRST,
    PASSES,
    PIPELINES,
    Pass,
    PassResult,
    run_pipeline,
    trace_pipeline,
)

__all__ = ["FINALLY", "FIRST", "PASSES", "PIPELINES", "Pass", "PassResult", "run_pipeline", "trace_pipeline"]
