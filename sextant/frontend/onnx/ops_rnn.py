"""ONNX recurrent ops: RNN, GRU, LSTM, unrolled over the (static) sequence length.

Each direction becomes a chain of per-step graph nodes: the input projection ``X·Wᵀ + biases``
is one matmul over all time steps, the recurrence one ``H·Rᵀ`` matmul per step. ``sequence_lens``
(constant or not) is handled by masking with ``where``: past a batch row's length its state stays
frozen and its output is zero, and a reverse pass leaves the state at its initial value until the
row's last valid step, which is exactly ONNX's per-row reversal (a zero-length row's Y_h is its
initial_h). Half precision computes in f32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sextant.frontend.lowerings import Unsupported
from sextant.frontend.onnx.registry import OnnxContext, onnx_op
from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node

Act = Callable[[Node], Node]

_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
_DEFAULT_ACTS = {"RNN": ("Tanh",), "GRU": ("Sigmoid", "Tanh"), "LSTM": ("Sigmoid", "Tanh", "Tanh")}
# activation → (alpha default, beta default); None: it takes no such parameter. Only the parameters an
# activation takes are consumed from activation_alpha/beta, in order (as onnxruntime does). The defaults
# are those of the standalone ONNX ops (onnxruntime uses 0 for Affine, ThresholdedRelu and ScaledTanh).
_PARAMS: dict[str, tuple[float | None, float | None]] = {
    "affine": (1.0, 0.0), "leakyrelu": (0.01, None), "thresholdedrelu": (1.0, None),
    "scaledtanh": (1.0, 1.0), "hardsigmoid": (0.2, 0.5), "elu": (1.0, None),
}


def _activation(b: GraphBuilder, name: str, alpha: float, beta: float) -> Act:
    """One of the activations ONNX's recurrent ops may name, as a builder function."""
    def relu(v: Node) -> Node:
        return b.maximum(v, 0.0)

    def ge0(v: Node) -> Node:
        return b.binary("ge", v, 0.0)

    table: dict[str, Act] = {
        "sigmoid": lambda v: b.unary("sigmoid", v),
        "tanh": lambda v: b.unary("tanh", v),
        "relu": relu,
        "affine": lambda v: b.add(b.mul(v, alpha), beta),
        "leakyrelu": lambda v: b.where(ge0(v), v, b.mul(v, alpha)),
        "thresholdedrelu": lambda v: b.where(b.binary("gt", v, alpha), v, 0.0),
        "scaledtanh": lambda v: b.mul(b.unary("tanh", b.mul(v, beta)), alpha),
        "hardsigmoid": lambda v: b.minimum(relu(b.add(b.mul(v, alpha), beta)), 1.0),
        "elu": lambda v: b.where(ge0(v), v, b.mul(b.unary("expm1", v), alpha)),
        "softsign": lambda v: b.div(v, b.add(b.unary("abs", v), 1.0)),
        # log(1 + eˣ) = max(x, 0) + log1p(e^-|x|), which does not overflow
        "softplus": lambda v: b.add(relu(v), b.unary("log1p", b.unary("exp", b.unary("neg", b.unary("abs", v))))),
    }
    return table[name]


def _activations(ctx: OnnxContext, num_dirs: int) -> list[list[Act]]:
    """The activations of each direction; a list given for one direction serves both."""
    def text(s: str | bytes) -> str:
        return s.decode() if isinstance(s, bytes) else str(s)

    default = _DEFAULT_ACTS[ctx.op_type]
    names = [text(s) for s in ctx.attr("activations", None) or default]
    n = len(default)
    if num_dirs == 2 and len(names) == n:
        names = names * 2
    if len(names) != n * num_dirs:
        raise Unsupported(f"{ctx.op_type}: expected {n * num_dirs} activations, got {names}")
    alphas = list(ctx.attr("activation_alpha", None) or [])
    betas = list(ctx.attr("activation_beta", None) or [])
    acts = []
    for name in names:
        key = name.lower()
        if key not in _PARAMS and key not in ("sigmoid", "tanh", "relu", "softsign", "softplus"):
            raise Unsupported(f"{ctx.op_type}: activation {name!r}")
        da, db = _PARAMS.get(key, (None, None))
        alpha = float(alphas.pop(0) if alphas else da) if da is not None else 0.0
        beta = float(betas.pop(0) if betas else db) if db is not None else 0.0
        acts.append(_activation(ctx.b, key, alpha, beta))
    return [acts[d * n:(d + 1) * n] for d in range(num_dirs)]


def _step_masks(ctx: OnnxContext, lens: Node | None, steps: int, batch: int) -> list[Node | None]:
    """Per time step, a ``[batch, 1]`` bool mask of the rows still inside their sequence (None: all are)."""
    b = ctx.b
    if lens is None:
        return [None] * steps
    if lens.shape != (batch,):
        raise Unsupported(f"{ctx.op_type}: sequence_lens has shape {list(lens.shape)}, expected [{batch}]")
    known = ctx.ints(lens) if ctx.is_const(lens) else None
    col = b.reshape(b.cast(lens, DType.i64), (batch, 1))
    return [None if known is not None and min(known) > t else b.binary("lt", b.full(t, (batch, 1), DType.i64), col)
            for t in range(steps)]


@dataclass
class _Cell:
    """One direction's time step: its recurrence weights, activations and options."""

    b: GraphBuilder
    hidden: int
    rt: Node  # Rᵀ: [hidden, gates·hidden]
    acts: list[Act]
    clip: float | None
    rbh: Node | None = None  # GRU with linear_before_reset: Rbh, which the reset gate scales
    lbr: bool = False
    peep: tuple[Node, Node, Node] | None = None  # LSTM peepholes Pi, Po, Pf
    input_forget: bool = False

    def cols(self, v: Node, gate: int, count: int = 1) -> Node:
        return self.b.slice(v, v.type.rank - 1, gate * self.hidden, count * self.hidden)

    def act(self, k: int, v: Node) -> Node:
        """Activation ``k`` of the gate pre-activation ``v``, clipped first when ``clip`` is set."""
        if self.clip is not None:
            v = self.b.minimum(self.b.maximum(v, -self.clip), self.clip)
        return self.acts[k](v)

    def rnn(self, xt: Node, h: Node, c: Node) -> tuple[Node, Node]:
        return self.act(0, self.b.add(xt, self.b.matmul(h, self.rt))), c

    def gru(self, xt: Node, h: Node, c: Node) -> tuple[Node, Node]:
        b = self.b
        zr = b.add(self.cols(xt, 0, 2), b.matmul(h, self.cols(self.rt, 0, 2)))  # gates z, r, h
        z, r = self.act(0, self.cols(zr, 0)), self.act(0, self.cols(zr, 1))
        rh = self.cols(self.rt, 2)
        if self.lbr:
            hr = b.matmul(h, rh)
            hr = b.mul(r, b.add(hr, self.rbh) if self.rbh is not None else hr)
        else:
            hr = b.matmul(b.mul(r, h), rh)
        hh = self.act(1, b.add(self.cols(xt, 2), hr))
        return b.add(b.mul(b.sub(1.0, z), hh), b.mul(z, h)), c

    def lstm(self, xt: Node, h: Node, c: Node) -> tuple[Node, Node]:
        b = self.b
        zs = b.add(xt, b.matmul(h, self.rt))  # gates i, o, f, c
        i_pre, o_pre, f_pre = self.cols(zs, 0), self.cols(zs, 1), self.cols(zs, 2)
        if self.peep is not None:
            pi, _, pf = self.peep
            i_pre, f_pre = b.add(i_pre, b.mul(pi, c)), b.add(f_pre, b.mul(pf, c))
        i = self.act(0, i_pre)
        f = b.sub(1.0, i) if self.input_forget else self.act(0, f_pre)
        c = b.add(b.mul(f, c), b.mul(i, self.act(1, self.cols(zs, 3))))
        if self.peep is not None:
            o_pre = b.add(o_pre, b.mul(self.peep[1], c))
        return b.mul(self.act(0, o_pre), self.acts[2](c)), c  # h(Ct) is not clipped (onnxruntime)


@onnx_op("RNN", "GRU", "LSTM")
def _recurrent(ctx: OnnxContext, x: Node, w: Node, r: Node, bias: Node | None = None, lens: Node | None = None,
               h0: Node | None = None, c0: Node | None = None, peep: Node | None = None) -> list[Node | None]:
    b, kind = ctx.b, ctx.op_type
    gates = _GATES[kind]
    direction = ctx.attr("direction", "forward")
    direction = direction.decode() if isinstance(direction, bytes) else str(direction)
    if direction not in ("forward", "reverse", "bidirectional"):
        raise Unsupported(f"{kind}: direction {direction!r}")
    num_dirs = 2 if direction == "bidirectional" else 1
    if x.type.rank != 3 or w.type.rank != 3 or r.type.rank != 3 or w.shape[0] != num_dirs:
        raise Unsupported(f"{kind}: X/W/R shapes {list(x.shape)}/{list(w.shape)}/{list(r.shape)} "
                          f"do not fit direction={direction!r}")
    H = int(ctx.attr("hidden_size", 0) or w.shape[1] // gates)
    out_dtype = x.dtype
    work = DType.f32 if out_dtype in (DType.f16, DType.bf16) else out_dtype
    if not work.is_float:
        raise Unsupported(f"{kind} of {out_dtype.value}")
    x, w, r, bias, h0, c0, peep = (v if v is None else b.cast(v, work) for v in (x, w, r, bias, h0, c0, peep))
    layout = int(ctx.attr("layout", 0))
    if layout:  # batch-major [batch, seq, ...] → the sequence-major layout the unrolling walks
        x, h0, c0 = (v if v is None else b.permute(v, (1, 0, 2)) for v in (x, h0, c0))
    steps, batch, width = x.shape
    if steps == 0:
        raise Unsupported(f"{kind}: an empty sequence")
    masks = _step_masks(ctx, lens, steps, batch)
    clip = ctx.attr("clip", None)
    lbr = kind == "GRU" and bool(ctx.attr("linear_before_reset", 0))
    acts = _activations(ctx, num_dirs)

    def row(v: Node, d: int) -> Node:  # direction d of a [num_dirs, ...] tensor, without that axis
        return b.reshape(b.slice(v, 0, d, 1), v.shape[1:])

    ys, hs, cs = [], [], []
    for d in range(num_dirs):
        cell = _Cell(b, H, b.transpose(row(r, d), 0, 1), acts[d], None if clip is None else float(clip), lbr=lbr,
                     input_forget=kind == "LSTM" and bool(ctx.attr("input_forget", 0)))
        # the input projection of all time steps at once, with the biases that do not enter a product
        xw = b.matmul(b.reshape(x, (steps * batch, width)), b.transpose(row(w, d), 0, 1))
        if bias is not None:
            wb, rb = b.slice(row(bias, d), 0, 0, gates * H), b.slice(row(bias, d), 0, gates * H, gates * H)
            if lbr:
                cell.rbh = cell.cols(rb, 2)
                rb = b.concat([cell.cols(rb, 0, 2), b.full(0.0, (H,), work)], 0)
            xw = b.add(xw, b.add(wb, rb))
        xw = b.reshape(xw, (steps, batch, gates * H))
        if peep is not None:
            p = row(peep, d)
            cell.peep = (cell.cols(p, 0), cell.cols(p, 1), cell.cols(p, 2))
        step = {"RNN": cell.rnn, "GRU": cell.gru, "LSTM": cell.lstm}[kind]
        h = row(h0, d) if h0 is not None else b.full(0.0, (batch, H), work)
        c = row(c0, d) if c0 is not None else b.full(0.0, (batch, H), work)
        out: list[Node] = [h] * steps
        for t in range(steps - 1, -1, -1) if direction == "reverse" or d == 1 else range(steps):
            h_new, c_new = step(b.reshape(b.slice(xw, 0, t, 1), (batch, gates * H)), h, c)
            m = masks[t]
            if m is None:
                h, c, out[t] = h_new, c_new, h_new
            else:  # rows past their length keep their state and output zeros
                h, c, out[t] = b.where(m, h_new, h), b.where(m, c_new, c), b.where(m, h_new, 0.0)
        ys.append(b.concat([b.reshape(y, (1, 1, batch, H)) for y in out], 0))
        hs.append(b.reshape(h, (1, batch, H)))
        cs.append(b.reshape(c, (1, batch, H)))

    def finish(parts: Sequence[Node], perm: tuple[int, ...], axis: int) -> Node:
        v = b.concat(list(parts), axis)
        return b.cast(b.permute(v, perm) if layout else v, out_dtype)

    # Y: [seq, dirs, batch, H] (layout 1: [batch, seq, dirs, H]); Y_h, Y_c: [dirs, batch, H] ([batch, dirs, H])
    specs = [(ys, (2, 0, 1, 3), 1), (hs, (1, 0, 2), 0), (cs, (1, 0, 2), 0)][:ctx.num_outputs]
    return [finish(*spec) if ctx.node.output[k] else None for k, spec in enumerate(specs)]
