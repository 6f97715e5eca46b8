"""An IRBuilder whose instructions broadcast: one scalar op description, scalar or vector code.

The op semantics in :mod:`~sextant.codegen.scalar_math` are written once, for scalars. When the
CPU lowering emits a loop's lanes as ``<W x T>`` values (:mod:`~sextant.codegen.lanes`), the same
code must produce vector instructions: this builder splats any scalar operand (a constant, or a
value the same in every lane) when another operand is a vector, turns the target type of a cast
into its vector form, calls the vector form of an LLVM intrinsic (``llvm.fabs.f32`` →
``llvm.fabs.v16f32``) and calls any other scalar function lane by lane. With no vector operand
it is exactly ``ir.IRBuilder``, so the scalar paths are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from llvmlite import ir


def lanes_of(*values: Any) -> int:
    """The vector width among ``values`` (0 when all are scalars)."""
    for v in values:
        t = getattr(v, "type", None)
        if isinstance(t, ir.VectorType):
            return t.count
    return 0


class LaneBuilder(ir.IRBuilder):
    def splat(self, v: ir.Value, width: int) -> ir.Value:
        """``v`` in every one of ``width`` lanes (unchanged when already a vector)."""
        if isinstance(v.type, ir.VectorType):
            return v
        vty = ir.VectorType(v.type, width)
        if isinstance(v, ir.Constant):
            return ir.Constant(vty, [v.constant] * width) if not isinstance(v.constant, list) else v
        one = ir.IRBuilder.insert_element(self, ir.Constant(vty, ir.Undefined), v, ir.Constant(ir.IntType(32), 0))
        mask = ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width)
        return ir.IRBuilder.shuffle_vector(self, one, ir.Constant(vty, ir.Undefined), mask)

    def _broadcast(self, args: tuple, positions: tuple[int, ...]) -> tuple:
        width = 0
        for i in positions:  # (called for every instruction: kept cheap)
            t = args[i].type if i < len(args) else None
            if t.__class__ is ir.VectorType:
                width = t.count
                break
        if not width:
            return args
        out = list(args)
        for i in positions:
            if i < len(out):
                out[i] = self.splat(out[i], width)
        return tuple(out)

    def extract_element(self, vector: ir.Value, idx: ir.Value, name: str = "") -> ir.Value:
        """Folded when both are constants (lane 0 of a contiguous access's index usually is)."""
        if isinstance(vector, ir.Constant) and isinstance(idx, ir.Constant) and isinstance(vector.constant, list):
            c = vector.constant[idx.constant]
            return c if isinstance(c, ir.Constant) else ir.Constant(vector.type.element, c)
        return super().extract_element(vector, idx, name)

    def call(self, fn: ir.Function, args: list[ir.Value], *rest: Any, **kw: Any) -> ir.Value:
        width = lanes_of(*args)
        if not width:
            return super().call(fn, args, *rest, **kw)
        params = fn.function_type.args
        if any(isinstance(t, ir.VectorType) for t in params):  # already a vector function
            return super().call(fn, [self.splat(a, width) if isinstance(t, ir.VectorType) else a
                                     for a, t in zip(args, params)], *rest, **kw)
        name = fn.name
        if name.startswith("llvm.") and name.rsplit(".", 1)[-1] in ("f32", "f64"):
            vargs = [self.splat(a, width) for a in args]
            ret = fn.function_type.return_type
            vname = f"{name.rsplit('.', 1)[0]}.v{width}{name.rsplit('.', 1)[1]}"
            module = self.module
            vfn = module.globals.get(vname)
            if vfn is None:
                vfn = ir.Function(module, ir.FunctionType(ir.VectorType(ret, width), [a.type for a in vargs]), vname)
            return super().call(vfn, vargs, *rest, **kw)
        return self.per_lane(width, args, lambda xs: super(LaneBuilder, self).call(fn, xs, *rest, **kw))

    def per_lane(self, width: int, args: list[ir.Value], op: Callable[[list[ir.Value]], ir.Value]) -> ir.Value:
        """``op`` on each lane's scalars, the results gathered into a vector."""
        out: ir.Value | None = None
        for lane in range(width):
            idx = ir.Constant(ir.IntType(32), lane)
            xs = [ir.IRBuilder.extract_element(self, a, idx) if isinstance(a.type, ir.VectorType) else a
                  for a in args]
            r = op(xs)
            if out is None:
                out = ir.Constant(ir.VectorType(r.type, width), ir.Undefined)
            out = ir.IRBuilder.insert_element(self, out, r, idx)
        assert out is not None
        return out


def _operands(name: str, positions: tuple[int, ...]) -> None:
    base = getattr(ir.IRBuilder, name)

    def method(self: LaneBuilder, *args: Any, **kw: Any) -> ir.Value:
        return base(self, *self._broadcast(args, positions), **kw)

    method.__name__ = name
    setattr(LaneBuilder, name, method)


def _cast(name: str) -> None:
    base = getattr(ir.IRBuilder, name)

    def method(self: LaneBuilder, value: ir.Value, typ: ir.Type, *args: Any, **kw: Any) -> ir.Value:
        width = lanes_of(value)
        if width and not isinstance(typ, ir.VectorType):
            typ = ir.VectorType(typ, width)
        return base(self, value, typ, *args, **kw)

    method.__name__ = name
    setattr(LaneBuilder, name, method)


for _name in ("fadd", "fsub", "fmul", "fdiv", "frem", "add", "sub", "mul", "sdiv", "srem", "udiv", "urem",
              "and_", "or_", "xor", "shl", "lshr", "ashr"):
    _operands(_name, (0, 1))
for _name in ("icmp_signed", "icmp_unsigned", "fcmp_ordered", "fcmp_unordered"):
    _operands(_name, (1, 2))
_operands("select", (0, 1, 2))
for _name in ("bitcast", "zext", "sext", "trunc", "fpext", "fptrunc", "sitofp", "uitofp", "fptosi", "fptoui"):
    _cast(_name)
