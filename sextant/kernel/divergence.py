"""How much each value of a kernel varies between threads: the same in the block, in a warp, or
per thread. The verifier asks it whether a barrier or a warp-collective statement sits under
control flow that threads (or lanes) can take differently.

Levels flow along the kernel's data and control dependences — a value assigned under
thread-dependent control is itself thread-dependent — to a fixed point. One walk builds the
dependence graph (a node per register, local buffer and branch or loop), then each node's level
is raised at most twice and passed along its edges: linear in the kernel, where walking the
whole kernel again after every raise read earlier was quadratic in the worst case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from sextant.kernel.exprs import children
from sextant.kernel.ir import (
    Assign,
    Binary,
    Const,
    Expr,
    For,
    If,
    Kernel,
    LdMatrix,
    Load,
    Mma,
    PairDot,
    Special,
    Stmt,
    Store,
    TileMatmul,
    Var,
    WarpReduce,
    Wgmma,
    stmt_operands,
)
from sextant.work import WorkCounter

WARP = 32
# how much a value varies between threads: the same in the block, in a warp, or per thread
UNIFORM, WARP_UNIFORM, THREAD = 0, 1, 2


def _same(level: int) -> int:
    return level


def _warp_result(width: int) -> Callable[[int], int]:
    """The level of a warp reduction's result from its operand's: every lane of a full-warp
    reduction gets the same value; a narrower one differs between its groups of lanes."""
    if width == WARP:
        return lambda v: min(v, WARP_UNIFORM)
    return lambda v: UNIFORM if v == UNIFORM else THREAD


class Divergence:
    """Levels of the registers (``regs``) and local buffers (``mem``) of ``kernel``; :meth:`level`
    of any expression from them. A local buffer read before any statement stores to it (in
    program order) holds per-thread garbage there: such a read is ``THREAD``."""

    def __init__(self, kernel: Kernel, work: WorkCounter | None = None) -> None:
        bx, by, bz = kernel.block
        self.special = {
            "x": UNIFORM if bx == 1 else THREAD,
            "y": UNIFORM if by == 1 else WARP_UNIFORM if bx % WARP == 0 else THREAD,
            "z": UNIFORM if bz == 1 else WARP_UNIFORM if (bx * by) % WARP == 0 else THREAD,
        }
        # a warp never spans two values of tid.y/z: tid.x / 32 is the same for a whole warp
        self.warp_x = bx % WARP == 0 or by * bz == 1
        self.local = {b.name for b in kernel.local}
        self.regs: dict[str, int] = {}
        self.mem: dict[str, int] = {}
        # the dependence graph: node ("r", name) | ("m", buffer) | ("c", n) -> (node, transfer) it feeds
        self._edges: dict[tuple, list[tuple[tuple, Callable[[int], int]]]] = {}
        self._level: dict[tuple, int] = {}
        self._stored: set[str] = set()  # local buffers stored to so far in the walk
        self._controls = 0
        self._pending: list[tuple] = []
        self._walk(kernel.body, None)
        self._propagate(work)
        for (kind, name), lvl in ((k, v) for k, v in self._level.items() if k[0] != "c"):
            (self.regs if kind == "r" else self.mem)[name] = lvl

    # -- building the graph ------------------------------------------------------------------------
    def _node(self, node: tuple) -> None:
        if node not in self._level:
            self._level[node] = UNIFORM
            self._pending.append(node)

    def _feed(self, target: tuple, ctrl: tuple | None, exprs: tuple[Expr, ...],
              transfer: Callable[[int], int] = _same) -> None:
        """``target`` is at least as thread-dependent as ``ctrl`` and ``transfer`` of ``exprs``."""
        self._node(target)
        if ctrl is not None:
            self._edges.setdefault(ctrl, []).append((target, _same))
        level = transfer(UNIFORM)
        for e in exprs:
            for source, fixed in self._sources(e):
                if source is None:
                    level = max(level, transfer(fixed))
                else:
                    self._node(source)
                    self._edges.setdefault(source, []).append((target, transfer))
        self._level[target] = max(self._level[target], level)

    def _sources(self, e: Expr) -> Iterator[tuple[tuple | None, int]]:
        """What ``e``'s level is the maximum of: nodes (``(node, 0)``) and fixed levels ``(None, level)``."""
        if isinstance(e, Special):
            yield None, self.special[e.axis] if e.kind == "tid" else UNIFORM
        elif isinstance(e, Var):
            yield ("r", e.name), UNIFORM
        elif isinstance(e, Binary) and self._warp_index(e):
            yield None, WARP_UNIFORM
        else:
            if isinstance(e, Load) and e.buffer in self.local:
                if e.buffer in self._stored:
                    yield ("m", e.buffer), UNIFORM
                else:
                    yield None, THREAD
            for ch in children(e):
                yield from self._sources(ch)

    def _control(self, parent: tuple | None, *exprs: Expr) -> tuple:
        self._controls += 1
        node = ("c", self._controls)
        self._feed(node, parent, exprs)
        return node

    def _walk(self, stmts: tuple[Stmt, ...], ctrl: tuple | None) -> None:
        for s in stmts:
            if isinstance(s, Assign):
                self._feed(("r", s.var.name), ctrl, (s.value,))
            elif isinstance(s, WarpReduce):
                self._feed(("r", s.var.name), ctrl, (s.value,), _warp_result(s.width))
            elif isinstance(s, Store) and s.buffer in self.local:
                self._feed(("m", s.buffer), ctrl, (s.index, s.value))
                self._stored.add(s.buffer)
            elif isinstance(s, PairDot):  # accumulates into its local buffer from its operands
                self._feed(("m", s.acc), ctrl, stmt_operands(s))
                self._stored.add(s.acc)
            elif isinstance(s, TileMatmul):  # overwrites its local buffer from its operands
                self._feed(("m", s.out), ctrl, stmt_operands(s))
                self._stored.add(s.out)
            elif isinstance(s, Mma | LdMatrix | Wgmma):  # each lane holds different elements
                buf = s.dst if isinstance(s, LdMatrix) else s.d
                self._feed(("m", buf), ctrl, ())
                self._level[("m", buf)] = THREAD
                self._stored.add(buf)
            elif isinstance(s, For):
                inner = self._control(ctrl, s.start, s.stop)
                self._feed(("r", s.var.name), inner, ())
                self._walk(s.body, inner)
            elif isinstance(s, If):
                inner = self._control(ctrl, s.cond)
                self._walk(s.then, inner)
                self._walk(s.orelse, inner)

    def _propagate(self, work: WorkCounter | None) -> None:
        """Raise every node to the maximum its sources give (each node rises at most twice)."""
        stack, level, edges = self._pending, self._level, self._edges
        while stack:
            node = stack.pop()
            lvl = level[node]
            for target, transfer in edges.get(node, ()):
                if work is not None:
                    work.add("divergence: edges")
                new = transfer(lvl)
                if new > level[target]:
                    level[target] = new
                    stack.append(target)

    # -- queries -----------------------------------------------------------------------------------
    def level(self, e: Expr) -> int:
        if isinstance(e, Special):
            return self.special[e.axis] if e.kind == "tid" else UNIFORM
        if isinstance(e, Var):
            return self.regs.get(e.name, UNIFORM)
        if isinstance(e, Load):
            return max(self.level(e.index), self.mem.get(e.buffer, THREAD) if e.buffer in self.local else UNIFORM)
        if isinstance(e, Binary) and self._warp_index(e):
            return WARP_UNIFORM
        return max((self.level(ch) for ch in children(e)), default=UNIFORM)

    def _warp_index(self, e: Binary) -> bool:
        """``tid.x / 32k``, ``tid.x >> 5+``, ``tid.x < 32k``: the same for all lanes of a warp."""
        if not self.warp_x:
            return False
        a, b, op = e.a, e.b, e.op
        if isinstance(a, Const) and op in ("lt", "le", "gt", "ge"):
            a, b, op = b, a, {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}[op]
        if a != Special("tid", "x") or not isinstance(b, Const) or not isinstance(b.value, int):
            return False
        k = b.value
        if op in ("div", "floordiv"):
            return k > 0 and k % WARP == 0
        if op == "shr":
            return k >= 5
        if op in ("lt", "ge"):
            return k % WARP == 0
        if op in ("le", "gt"):
            return (k + 1) % WARP == 0
        return False

    def level_of(self, *exprs: Expr) -> tuple[int, str]:
        """The level of the most thread-dependent of ``exprs`` and a phrase saying why."""
        level = max(self.level(e) for e in exprs)
        if level == UNIFORM:
            return level, "are the same for all threads"
        culprits = sorted({n for e in exprs for n in self._culprits(e)})
        what = ", ".join(culprits) if culprits else "per-thread values"
        return level, f"depend{'s' if len(exprs) == 1 else ''} on {what}"

    def _culprits(self, e: Expr) -> Iterator[str]:
        """The thread-dependent leaves of ``e`` (for messages)."""
        if isinstance(e, Special) and self.level(e) > UNIFORM:
            yield f"{e.kind}.{e.axis}"
        elif isinstance(e, Var) and self.level(e) > UNIFORM:
            yield f"register {e.name}"
        elif isinstance(e, Load) and self.level(e) > UNIFORM and e.buffer in self.local:
            yield f"local buffer {e.buffer}"
        for ch in children(e):
            yield from self._culprits(ch)
