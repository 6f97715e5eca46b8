"""Training graphs under ``torch.compile(backend="sextant")``: forward and backward through AOTAutograd.

A Dynamo graph whose inputs require grad (parameters in training, any input with
``requires_grad``) cannot be compiled as an inference graph: a sextant program returns plain
tensors, so the loss would come back with no ``grad_fn`` and ``backward()`` would fail, or worse,
gradients would be silently dropped. Such a graph goes through AOTAutograd instead, as Inductor's
does: it traces the joint forward/backward graph in ATen, decomposes it to Core ATen, splits it
with the min-cut rematerialisation partitioner (which activations to save, which to recompute),
and hands the **forward** graph (its outputs plus the saved activations) and the **backward**
graph to sextant, each compiled as one program by the same path as any inference graph.

Each half compiles on its first call, with the real tensors (AOTAutograd hands compilers fake
ones): the backward graph on the first ``backward()``. A half sextant cannot compile runs eagerly
with the reason logged (``sextant.dynamo``) and recorded on ``STATS`` with its role; autograd is
kept either way. Double backward (``create_graph=True``) is refused by AOTAutograd's compiled
backward with a clear error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

log = logging.getLogger("sextant.dynamo")

# compiles one ATen graph (forward or backward) on its first call: (graph, role) -> callable
GraphCompiler = Callable[[torch.fx.GraphModule, str], Callable[..., Any]]


def needs_autograd(example_inputs: Sequence[Any]) -> bool:
    """Whether a Dynamo graph must be differentiable: grad mode is on and some input requires grad."""
    return torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)


def training_decompositions() -> dict[Any, Callable[..., Any]]:
    """Core ATen decompositions for the joint graph: the backward ops (``native_layer_norm_backward``,
    ``threshold_backward``, ``_softmax_backward_data``, ...) become elementwise ops and reductions
    the lowering table has; ops sextant lowers whole (attention) are kept."""
    from sextant.frontend.capture import decomposition_table

    return decomposition_table()


def compile_training(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                     compile_graph: GraphCompiler) -> Callable[..., Any]:
    """``gm`` as an autograd-aware callable whose forward and backward graphs sextant compiles.
    Raises what AOTAutograd raises when it cannot trace the graph (the caller falls back to eager)."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def forward(g: torch.fx.GraphModule, _fake_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(compile_graph(g, "forward"))

    def backward(g: torch.fx.GraphModule, _fake_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(compile_graph(g, "backward"))

    def inference(g: torch.fx.GraphModule, _fake_inputs: Sequence[Any]) -> Callable[..., Any]:
        return make_boxed_func(compile_graph(g, "inference"))  # no output needs a gradient after all

    aot = aot_autograd(fw_compiler=forward, bw_compiler=backward, inference_compiler=inference,
                       decompositions=training_decompositions(),
                       partition_fn=min_cut_rematerialization_partition)
    return aot(gm, list(example_inputs))


def saved_activations(backward: torch.fx.GraphModule) -> tuple[int, int]:
    """(count, bytes) of what a backward graph takes from its forward: every input but the incoming
    gradients (AOTAutograd names those ``tangents_*``): the memory kept alive between the two."""
    count = nbytes = 0
    for n in backward.graph.nodes:
        if n.op == "placeholder" and not n.name.startswith("tangents"):
            count += 1
            v = n.meta.get("val")
            if isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape):
                nbytes += v.numel() * v.element_size()
    return count, nbytes
