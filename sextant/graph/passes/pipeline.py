"""Pass registry, named pipelines, and a driver that verifies (and can print) after every pass.

    run_pipeline(g, "default", print_after_all=True)   # like LLVM's -print-after-all
    trace_pipeline(g, ["simplify", "dce"])              # what each pass did, for tools

A named pipeline repeats its passes until a whole round changes nothing (at most
``max_rounds`` rounds); an explicit list of pass names runs once, in order.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO

from sextant.graph.ir import Graph
from sextant.graph.passes.constant_fold import constant_fold
from sextant.graph.passes.cse import cse
from sextant.graph.passes.dce import dce
from sextant.graph.passes.expand_random import expand_random
from sextant.graph.passes.in_place_updates import in_place_updates
from sextant.graph.passes.simplify import simplify
from sextant.graph.printer import print_graph
from sextant.graph.verifier import verify
from sextant.work import WorkCounter


@dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[Graph], Graph]
    doc: str


@dataclass(frozen=True)
class PassResult:
    name: str
    graph: Graph
    nodes_before: int
    nodes_after: int
    changed: bool


PASSES: dict[str, Pass] = {p.name: p for p in [
    Pass("expand_random", expand_random, "spell each random op out as Philox4x32-10 integer arithmetic on the seed"),
    Pass("simplify", simplify, "algebraic identities: x+0, x*1, reshape/permute/cast chains, where(true, a, b), ..."),
    Pass("constant_fold", constant_fold, "evaluate ops on constants into full or folded.<n> params"),
    Pass("cse", cse, "merge structurally identical nodes"),
    Pass("dce", dce, "drop nodes no output depends on, and unreferenced params"),
    Pass("in_place_updates", in_place_updates,
         "let each scatter write into its operand's buffer where that is safe; copy the operand where not"),
]}

PIPELINES: dict[str, list[str]] = {
    "default": ["simplify", "constant_fold", "cse", "dce"],
}
# passes a named pipeline runs once, before its rounds: expansions the rounds then simplify
FIRST: dict[str, list[str]] = {
    "default": ["expand_random"],
}
# passes a named pipeline runs once, after its rounds reach a fixed point (rewrites such as CSE
# would otherwise merge the copies in_place_updates makes, and it would make them again)
FINALLY: dict[str, list[str]] = {
    "default": ["in_place_updates"],
}

DEFAULT_MAX_ROUNDS = 8


def register_pass(p: Pass) -> None:
    """Make ``p`` available to pipelines by name."""
    PASSES[p.name] = p


def same_graph(a: Graph, b: Graph) -> bool:
    """Whether a pass left the graph as it was (passes keep node identity when nothing changes)."""
    return a is b or (len(a.nodes) == len(b.nodes) and all(x is y for x, y in zip(a.nodes, b.nodes))
                      and len(a.outputs) == len(b.outputs) and all(x is y for x, y in zip(a.outputs, b.outputs))
                      and a.params.keys() == b.params.keys()
                      and all(a.params[k] is b.params[k] for k in a.params))


def _resolve(pipeline: str | Sequence[str], max_rounds: int | None) -> tuple[list[Pass], int]:
    if isinstance(pipeline, str):
        if pipeline not in PIPELINES:
            raise KeyError(f"unknown pipeline {pipeline!r} (known: {', '.join(sorted(PIPELINES))})")
        names, rounds = PIPELINES[pipeline], DEFAULT_MAX_ROUNDS
    else:
        names, rounds = list(pipeline), 1
    unknown = [n for n in names if n not in PASSES]
    if unknown:
        raise KeyError(f"unknown pass(es) {unknown} (known: {', '.join(sorted(PASSES))})")
    return [PASSES[n] for n in names], rounds if max_rounds is None else max_rounds


def _run(graph: Graph, pipeline: str | Sequence[str], verify_each: bool, max_rounds: int | None,
         work: WorkCounter | None = None) -> Iterator[PassResult]:
    passes, rounds = _resolve(pipeline, max_rounds)
    named = pipeline if isinstance(pipeline, str) else None  # a list of passes runs just those
    for r in _once(graph, FIRST.get(named, []), verify_each):
        yield r
        graph = r.graph
    for _ in range(rounds):
        round_changed = False
        for p in passes:
            new = p.fn(graph)
            if work is not None:  # every pass is a bounded number of rebuilds of the graph
                work.add(f"passes: {p.name}", len(graph.nodes))
            if verify_each:
                verify(new, where=f"pass '{p.name}'")
            changed = not same_graph(graph, new)
            round_changed |= changed
            yield PassResult(p.name, new, len(graph.nodes), len(new.nodes), changed)
            graph = new
        if not round_changed:
            break
    yield from _once(graph, FINALLY.get(named, []), verify_each)


def _once(graph: Graph, names: list[str], verify_each: bool) -> Iterator[PassResult]:
    """The passes ``names`` run once each, in order (a named pipeline's ``FIRST`` and ``FINALLY``)."""
    for p in (PASSES[n] for n in names):
        new = p.fn(graph)
        if verify_each:
            verify(new, where=f"pass '{p.name}'")
        yield PassResult(p.name, new, len(graph.nodes), len(new.nodes), not same_graph(graph, new))
        graph = new


def run_pipeline(graph: Graph, pipeline: str | Sequence[str] = "default", *, verify: bool = True,
                 print_after_all: bool = False, stream: TextIO = sys.stdout,
                 max_rounds: int | None = None, work: WorkCounter | None = None) -> Graph:
    """Run a named pipeline or a list of pass names; verify after each pass, optionally print the IR.
    ``work`` counts the nodes each pass run was given."""
    for r in _run(graph, pipeline, verify, max_rounds, work):
        if print_after_all:
            print(f"// ---- IR after {r.name} ----", file=stream)
            print(print_graph(r.graph), file=stream)
        graph = r.graph
    return graph


def trace_pipeline(graph: Graph, pipeline: str | Sequence[str] = "default", *, verify: bool = True,
                   max_rounds: int | None = None) -> list[PassResult]:
    """Every pass run, in order, with the graph it produced."""
    return list(_run(graph, pipeline, verify, max_rounds))
