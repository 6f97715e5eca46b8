"""Out-of-bounds witnesses: a concrete thread (and loop iterations) that reaches an access with a
bad index, found by running the statements on the access's path for a few threads.

The verifier reports an access it could not prove in bounds only with such a witness, so a
correct pattern range analysis does not understand is never rejected. The search is bounded:
each access gets at most :data:`MAX_WORK` statements executed, and a kernel's searches share a
budget proportional to its size (the verifier's), so verification stays linear in the kernel.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from sextant.kernel.evaluate import Compiled, EvalError, Unknown, Value, compile_expr
from sextant.kernel.exprs import assigned_names
from sextant.kernel.ir import Assign, Expr, For, If, Kernel, Stmt, WarpReduce

MAX_THREADS_EXHAUSTIVE = 1024
MAX_WORK = 50_000  # statements executed per access searched: keeps verification fast on big kernels


class Exec:
    """Runs statements for one thread: expressions compiled once (:func:`compile_expr`) and each
    loop's or branch's assigned registers computed once, for every search in a kernel.

    Keyed by ``id`` of the kernel's own nodes, which the kernel keeps alive while it is verified."""

    def __init__(self) -> None:
        self._exprs: dict[int, tuple[Expr, Compiled]] = {}
        self._assigned: dict[int, tuple[tuple[Stmt, ...], frozenset[str]]] = {}

    def eval(self, e: Expr, vals: dict) -> Value:
        hit = self._exprs.get(id(e))
        if hit is None:
            hit = self._exprs[id(e)] = (e, compile_expr(e))
        return hit[1](vals, None)

    def assigned(self, stmts: tuple[Stmt, ...]) -> frozenset[str]:
        hit = self._assigned.get(id(stmts))
        if hit is None:
            hit = self._assigned[id(stmts)] = (stmts, frozenset(assigned_names(stmts)))
        return hit[1]

    def run(self, s: Stmt, vals: dict) -> int:
        """Execute ``s`` as far as it is known (memory is not modelled); returns the registers it
        dropped or the nested statements it ran (work beyond ``s`` itself)."""
        if isinstance(s, Assign):
            try:
                vals[s.var.name] = self.eval(s.value, vals)
            except EvalError:
                vals.pop(s.var.name, None)
        elif isinstance(s, WarpReduce):
            vals.pop(s.var.name, None)
        elif isinstance(s, If):
            try:
                body = s.then if self.eval(s.cond, vals) else s.orelse
            except EvalError:
                names = self.assigned(s.then) | self.assigned(s.orelse)
                for name in names:
                    vals.pop(name, None)
                return len(names)
            return sum(1 + self.run(inner, vals) for inner in body)
        elif isinstance(s, For):
            vals.pop(s.var.name, None)
            names = self.assigned(s.body)
            for name in names:
                vals.pop(name, None)
            return len(names)
        return 0


class Witness:
    """Looks for one thread (and loop iterations) that reaches an access with a bad index.

    The thread runs the statements on the path to the access concretely; registers whose value
    it cannot know (from loads, warp reductions, earlier iterations of a loop) become unknown,
    and a path through an unknown condition is abandoned — so a witness is always real."""

    def __init__(self, kernel: Kernel, path: tuple, index: Expr, size: int, ex: Exec | None = None,
                 limit: int = MAX_WORK) -> None:
        self.k, self.path, self.index, self.size = kernel, path, index, size
        self.ex = ex if ex is not None else Exec()
        self.runs = 0  # accesses evaluated
        self.unknown = 0  # ... of which needed an unknown value
        self.work = 0  # statements executed (and registers copied or dropped)
        self.limit = limit  # the search gives up before its work would pass this

    def threads(self) -> Iterator[dict[str, int]]:
        dims = [(f"{kind}.{ax}", n) for kind, sizes in (("tid", self.k.block), ("bid", self.k.grid))
                for ax, n in zip("xyz", sizes)]
        exhaustive = self.k.threads_per_block * self.k.num_blocks <= MAX_THREADS_EXHAUSTIVE
        choices = [range(n) if exhaustive else sorted({v for v in (0, 1, n // 2, n - 2, n - 1) if 0 <= v < n})
                   for _, n in dims]
        fixed = {f"{kind}.{ax}": n for kind, sizes in (("bdim", self.k.block), ("gdim", self.k.grid))
                 for ax, n in zip("xyz", sizes)}
        for combo in itertools.product(*choices):
            yield fixed | {name: v for (name, _), v in zip(dims, combo)}

    def search(self) -> tuple[int, str] | None:
        for thread in self.threads():
            found = self.frame(0, dict(thread), [])
            if found is not None:
                value, loops = found
                coords = [f"{k}={v}" for k, v in thread.items()
                          if k[:3] in ("tid", "bid") and self._size(k) > 1]
                return value, ", ".join(coords + loops) or "every thread"
            if self.work >= self.limit or (self.unknown >= 8 and self.unknown == self.runs):
                return None
        return None

    def _size(self, coord: str) -> int:
        sizes = self.k.block if coord.startswith("tid") else self.k.grid
        return sizes["xyz".index(coord[-1])]

    def frame(self, depth: int, vals: dict, loops: list[str]) -> tuple[int, list[str]] | None:
        stmts, pos, branch = self.path[depth]
        if self.work + pos + 1 > self.limit:  # replaying the statements before the access would overrun
            self.work = self.limit
            return None
        self.work += pos + 1
        ex = self.ex
        for s in stmts[:pos]:
            self.work += ex.run(s, vals)
        s = stmts[pos]
        if depth == len(self.path) - 1:
            self.runs += 1
            try:
                i = ex.eval(self.index, vals)
            except Unknown:
                self.unknown += 1
                return None
            except EvalError:
                return None
            return (i, loops) if not 0 <= i < self.size else None
        if isinstance(s, If):
            try:
                taken = bool(ex.eval(s.cond, vals))
            except EvalError:
                return None
            return self.frame(depth + 1, vals, loops) if taken == branch else None
        assert isinstance(s, For)
        try:
            start, stop = ex.eval(s.start, vals), ex.eval(s.stop, vals)
        except EvalError:
            return None
        iters = range(start, stop, s.step)
        picks = sorted({j for j in (0, 1, len(iters) - 2, len(iters) - 1) if 0 <= j < len(iters)})
        for j in picks:
            inner = dict(vals)
            if j > 0:  # registers the body changes hold values of earlier iterations
                body_writes = ex.assigned(s.body)
                self.work += len(body_writes)
                for name in body_writes:
                    inner.pop(name, None)
            inner[s.var.name] = iters[j]
            found = self.frame(depth + 1, inner, loops + [f"{s.var.name}={iters[j]}"])
            if found is not None or self.work >= self.limit:
                return found
        return None
