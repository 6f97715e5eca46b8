"""CUDA-like pseudo code for kernel IR: what each thread runs, for humans and golden tests.

    kernel fused_3 grid=(128,1,1) block=(256,1,1)
      (in f32 x[4096], out f32 out0[4096])
      shared f32 tile[256]
    {
      i = bid.x * 256 + tid.x
      if (i < 4096) {
        out0[i] = exp(x[i]) * 0.5f
      }
    }

Infix operators follow C precedence and parenthesise exactly where the tree needs it, so the
text shows the evaluation order (``a + (b + c)`` stays as written: float addition is not
associative). Math ops are calls (``exp(x)``, ``max(a, b)``), casts are ``(f16)x``, constants
carry their type (``0.5f`` f32, ``(f16)0.5``, ``7L`` i64, ``true``).
"""

from __future__ import annotations

import math

from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Assign,
    AtomicAdd,
    Barrier,
    Binary,
    Buffer,
    Cast,
    Const,
    CpAsync,
    CpAsyncCommit,
    CpAsyncWait,
    Expr,
    For,
    If,
    Kernel,
    LdMatrix,
    Load,
    MbarrierArrive,
    MbarrierInit,
    MbarrierWait,
    Mma,
    PairDot,
    RegMatrix,
    Select,
    SetMaxNReg,
    SmemMatrix,
    Special,
    Stmt,
    Store,
    TileMatmul,
    TmaLoad,
    Unary,
    Var,
    WarpReduce,
    Wgmma,
    WgmmaCommit,
    WgmmaFence,
    WgmmaWait,
)
from sextant.kernel.sizes import launch_blocks

# C precedence: higher binds tighter
_INFIX: dict[str, tuple[str, int]] = {
    "mul": ("*", 13), "div": ("/", 13), "fmod": ("%", 13),
    "add": ("+", 12), "sub": ("-", 12),
    "shl": ("<<", 11), "shr": (">>", 11),
    "lt": ("<", 10), "le": ("<=", 10), "gt": (">", 10), "ge": (">=", 10),
    "eq": ("==", 9), "ne": ("!=", 9),
    "bitwise_and": ("&", 8), "bitwise_xor": ("^", 7), "bitwise_or": ("|", 6),
}
_BITWISE = frozenset({"bitwise_and", "bitwise_xor", "bitwise_or"})
_PREFIX = {"neg": "-", "bitwise_not": "~", "logical_not": "!"}
_CALL_NAMES = {"maximum": "max", "minimum": "min"}
_ATOM, _UNARY_PREC, _SELECT_PREC = 16, 14, 3
_INDENT = "  "


def format_const(c: Const) -> str:
    v, dt = c.value, c.dtype
    if dt == DType.bool:
        return "true" if v else "false"
    if dt.is_int:
        return f"{int(v)}L" if dt == DType.i64 else str(int(v))
    v = float(v)
    text = "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    return f"{text}f" if dt == DType.f32 else f"({dt.value}){text}"


def _expr(e: Expr) -> tuple[str, int]:
    """Text of ``e`` and the precedence of its outermost operator."""
    if isinstance(e, Const):
        text = format_const(e)
        return text, _UNARY_PREC if text.startswith(("-", "(")) else _ATOM
    if isinstance(e, Var):
        return e.name, _ATOM
    if isinstance(e, Special):
        return f"{e.kind}.{e.axis}", _ATOM
    if isinstance(e, Load):
        return f"{e.buffer}[{print_expr(e.index)}]", _ATOM
    if isinstance(e, Cast):
        return f"({e.dtype.value}){_wrap(e.a, _UNARY_PREC)}", _UNARY_PREC
    if isinstance(e, Unary):
        if e.op in _PREFIX:
            inner = _wrap(e.a, _UNARY_PREC)
            sep = " " if inner.startswith(_PREFIX[e.op]) else ""  # "- -x", never "--x"
            return f"{_PREFIX[e.op]}{sep}{inner}", _UNARY_PREC
        return f"{e.op}({print_expr(e.a)})", _ATOM
    if isinstance(e, Binary):
        infix = _INFIX.get(e.op)
        if infix is None or (e.op == "fmod" and e.dtype.is_float):
            return f"{_CALL_NAMES.get(e.op, e.op)}({print_expr(e.a)}, {print_expr(e.b)})", _ATOM
        sym, p = infix
        lp = max(p, _INFIX["shl"][1]) if e.op in _BITWISE else p  # "(i < n) & ok", never "i < n & ok"
        return f"{_wrap(e.a, lp)} {sym} {_wrap(e.b, lp + 1)}", p  # left-associative
    if isinstance(e, Select):
        cond = _wrap(e.cond, _SELECT_PREC + 1)
        return f"{cond} ? {print_expr(e.a)} : {_wrap(e.b, _SELECT_PREC)}", _SELECT_PREC
    raise TypeError(f"not a kernel expression: {e!r}")


def _wrap(e: Expr, min_prec: int) -> str:
    text, p = _expr(e)
    return text if p >= min_prec else f"({text})"


def print_expr(expr: Expr) -> str:
    return _expr(expr)[0]


def stmt_header(s: Stmt) -> str:
    """One line that identifies a statement (the first line :func:`print_stmt` prints, without
    the opening brace) — used by the verifier's messages."""
    if isinstance(s, Assign):
        return f"{s.var.name} = {print_expr(s.value)}"
    if isinstance(s, Store):
        return f"{s.buffer}[{print_expr(s.index)}] = {print_expr(s.value)}"
    if isinstance(s, AtomicAdd):
        return f"atomic_add({_ref(s.buffer, s.index)}, {print_expr(s.value)})"
    if isinstance(s, For):
        v = s.var.name
        cmp, inc = ("<", f"+= {s.step}") if s.step > 0 else (">", f"-= {-s.step}")
        return f"for ({v} = {print_expr(s.start)}; {v} {cmp} {print_expr(s.stop)}; {v} {inc})"
    if isinstance(s, If):
        return f"if ({print_expr(s.cond)})"
    if isinstance(s, Barrier):
        return "__syncthreads()"
    if isinstance(s, WarpReduce):
        return f"{s.var.name} = warp_{s.op}({print_expr(s.value)}, width={s.width})"
    if isinstance(s, Mma):
        m, n, k = s.shape
        ops = ", ".join(_ref(b, o) for b, o in ((s.d, s.d_off), (s.a, s.a_off), (s.b, s.b_off), (s.c, s.c_off)))
        return f"mma_m{m}n{n}k{k}({ops})"
    if isinstance(s, LdMatrix):
        return f"ldmatrix_x{s.count}{'_trans' if s.trans else ''}({_ref(s.dst, s.dst_off)}, {_ref(s.src, s.index)})"
    if isinstance(s, CpAsync):
        pred = f", {print_expr(s.pred)}" if s.pred is not None else ""
        return f"cp_async({_ref(s.dst, s.dst_index)}, {_ref(s.src, s.src_index)}, {s.count}{pred})"
    if isinstance(s, PairDot):
        return (f"pair_dot_x{s.lanes}({_ref(s.acc, s.acc_off)}, {print_expr(s.a_lo)}, {print_expr(s.a_hi)}, "
                f"{_ref(s.b, s.b_off)})")
    if isinstance(s, TileMatmul):
        return (f"tile_matmul_{s.rows}x{s.cols}x{s.k}(&{s.out}[0], {_ref(s.a, s.a_off)} rows {s.a_stride} apart, "
                f"{_ref(s.b, s.b_off)} in pairs of K, strips {s.b_tile_stride} apart)")
    if isinstance(s, Wgmma):
        return f"wgmma_m64n{s.n}k16({_ref(s.d, s.d_off)}, {_smem(s.a)}, {_smem(s.b)})"
    if isinstance(s, SetMaxNReg):
        return f"setmaxnreg_{'inc' if s.inc else 'dec'}({s.count})"
    if isinstance(s, WgmmaFence):
        return "wgmma_fence()"
    if isinstance(s, WgmmaCommit):
        return "wgmma_commit()"
    if isinstance(s, WgmmaWait):
        return f"wgmma_wait({s.pending}, {', '.join(s.accs)})"
    if isinstance(s, MbarrierInit):
        return f"mbarrier_init({_ref(s.bar, s.index)}, {s.count})"
    if isinstance(s, MbarrierArrive):
        return f"mbarrier_arrive({_ref(s.bar, s.index)}, tx={s.tx})"
    if isinstance(s, MbarrierWait):
        return f"mbarrier_wait({_ref(s.bar, s.index)}, parity={print_expr(s.parity)})"
    if isinstance(s, TmaLoad):
        (br, bc), (r, c) = s.box, s.shape
        dims = "".join(f"{n} (stride {k}) x " for n, k in s.outer_dims)
        at = ", ".join(print_expr(x) for x in (*s.outer, s.row, s.col))
        return (f"tma_load({_ref(s.dst, s.dst_off)}, {s.src}[{dims}{r}x{c}, stride {s.stride}]"
                f"[{at}], box={br}x{bc}, swizzle={s.swizzle}, {_ref(s.bar, s.bar_index)})")
    if isinstance(s, CpAsyncCommit):
        return "cp_async_commit()"
    if isinstance(s, CpAsyncWait):
        return f"cp_async_wait({s.pending})"
    raise TypeError(f"not a kernel statement: {s!r}")


def _ref(buffer: str, index: Expr) -> str:
    return f"&{buffer}[{print_expr(index)}]"


def _smem(m: SmemMatrix | RegMatrix) -> str:
    if isinstance(m, RegMatrix):
        return f"regs({_ref(m.buffer, m.offset)})"
    lbo = f", lbo={m.lbo}" if m.swizzle == 0 or m.major == "mn" else ""
    major = ", mn-major" if m.major == "mn" else ""
    return f"desc({_ref(m.buffer, m.offset)}, swizzle={m.swizzle}{lbo}, sbo={m.sbo}{major})"


def print_stmt(s: Stmt, indent: int = 0) -> list[str]:
    pad = _INDENT * indent
    if isinstance(s, For):
        pragma = [f"{pad}#pragma unroll"] if s.unroll else []
        return pragma + [f"{pad}{stmt_header(s)} {{", *_block(s.body, indent + 1), f"{pad}}}"]
    if isinstance(s, If):
        lines = [f"{pad}{stmt_header(s)} {{", *_block(s.then, indent + 1)]
        orelse = s.orelse
        while len(orelse) == 1 and isinstance(orelse[0], If):  # else-if chains stay flat
            lines += [f"{pad}}} else {stmt_header(orelse[0])} {{", *_block(orelse[0].then, indent + 1)]
            orelse = orelse[0].orelse
        if orelse:
            lines += [f"{pad}}} else {{", *_block(orelse, indent + 1)]
        return lines + [f"{pad}}}"]
    return [pad + stmt_header(s)]


def _block(stmts: tuple[Stmt, ...], indent: int) -> list[str]:
    return [line for s in stmts for line in print_stmt(s, indent)]


def _decl(b: Buffer) -> str:
    return f"{b.dtype.value} {b.name}[{b.size}]"


def print_kernel(kernel: Kernel) -> str:
    dims = lambda d: "(" + ",".join(map(str, d)) + ")"
    grid = dims(kernel.grid)
    if kernel.sizes:  # the block count is per launch; the grid is its capacity
        grid = f"{launch_blocks(kernel)} (at most {kernel.num_blocks})"
    lines = [f"kernel {kernel.name} grid={grid} block={dims(kernel.block)}"]
    params = ", ".join([f"{p.role} {_decl(p)}" for p in kernel.params] +
                       [f"size {s.var.name} in [{s.lo}, {s.hi}]" for s in kernel.sizes])
    lines.append(f"{_INDENT}({params})")
    lines += [f"{_INDENT}{b.space} {_decl(b)}" for b in (*kernel.shared, *kernel.local)]
    lines += ["{", *_block(kernel.body, 1), "}"]
    return "\n".join(lines)
