"""Graph-to-graph passes (simplify, constant folding, CSE, DCE) and the pipeline that runs them."""

from sextant.graph.passes.pipeline import FINALLY, PASSES, PIPELINES, Pass, PassResult, run_pipeline, trace_pipeline

__all__ = ["FINALLY", "PASSES", "PIPELINES", "Pass", "PassResult", "run_pipeline", "trace_pipeline"]
