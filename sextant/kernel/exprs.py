"""Structural queries on kernel IR: an expression's operands, the registers it reads, whether it
loads, the registers a statement list writes. Shared by range analysis, the simplifier, the
verifier and the GPU mappings."""

from __future__ import annotations

from collections.abc import Iterable

from sextant.kernel.ir import Assign, Binary, Cast, Expr, For, If, Load, Select, Stmt, Unary, Var, WarpReduce


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Unary | Cast):
        return (e.a,)
    if isinstance(e, Binary):
        return (e.a, e.b)
    if isinstance(e, Select):
        return (e.cond, e.a, e.b)
    if isinstance(e, Load):
        return (e.index,)
    return ()


def free_names(e: Expr) -> frozenset[str]:
    """Names of the registers / loop variables ``e`` reads."""
    if isinstance(e, Var):
        return frozenset((e.name,))
    out: frozenset[str] = frozenset()
    for ch in children(e):
        out |= free_names(ch)
    return out


def contains_load(e: Expr) -> bool:
    return isinstance(e, Load) or any(contains_load(ch) for ch in children(e))


def assigned_names(stmts: Iterable[Stmt]) -> set[str]:
    """Registers written anywhere in ``stmts`` (loop variables of nested loops included)."""
    out: set[str] = set()
    for s in stmts:
        if isinstance(s, Assign | WarpReduce):
            out.add(s.var.name)
        elif isinstance(s, For):
            out.add(s.var.name)
            out |= assigned_names(s.body)
        elif isinstance(s, If):
            out |= assigned_names(s.then) | assigned_names(s.orelse)
    return out


def statement_count(body: Iterable[Stmt]) -> int:
    """Statements in ``body``, nested ones included: the size work on a kernel is measured against."""
    count, stack = 0, list(body)
    while stack:
        s = stack.pop()
        count += 1
        if isinstance(s, For):
            stack.extend(s.body)
        elif isinstance(s, If):
            stack.extend(s.then)
            stack.extend(s.orelse)
    return count
