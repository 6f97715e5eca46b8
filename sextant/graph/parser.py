"""Parser for the graph IR's textual form: ``parse_graph(print_graph(g))`` rebuilds ``g``.

Parameters are not part of the text; pass their tensors as ``params`` (or get zero-filled
placeholders of the printed type). Pytree specs are not part of the text either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import torch

from sextant.graph.dtypes import DType
from sextant.graph.ir import Graph, Mutation, Node, make_node
from sextant.graph.ops import SOURCES, IRTypeError, TensorType
from sextant.graph.symbolic import Bounds, SymbolicShapeError, parse_dim

_TYPE = r"(?:f32|f16|bf16|i32|i64|bool)\[[^\]]*\]"
_HEADER = re.compile(r"graph @(?P<name>[\w.]+)\((?P<args>.*?)\)(?: where (?P<syms>[^{]*))? \{$")
_SYM = re.compile(r"\s*(?P<name>[A-Za-z_]\w*) in \[(?P<lo>\d+), (?P<hi>\d+)\]\s*")
_NODE = re.compile(
    r"(?P<res>%[\w.]+) = (?P<op>\w+)\((?P<ops>[^)]*)\)(?: \{(?P<attrs>.*)\})? : (?P<type>" + _TYPE + r")"
    r"(?:\s+loc\((?P<loc>\"(?:[^\"\\]|\\.)*\")\))?$"
)
_FLOAT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)")
_RETURN = re.compile(r"return \((?P<outs>[^)]*)\)$")
_SEED = re.compile(r"seed (?P<src>%[\w.]+)$")
_UPDATE = re.compile(r"update (?P<dst>%[\w.]+) <- (?P<src>%[\w.]+) "
                     r"\{(?P<kind>buffer|input)=(?P<target>\"(?:[^\"\\]|\\.)*\")\}$")


class ParseError(ValueError):
    """The text is not valid graph IR; the message names the line."""


def parse_type(text: str, bounds: Bounds = ()) -> TensorType:
    dt, _, dims = text.partition("[")
    dims = dims.rstrip("]")
    return TensorType(tuple(parse_dim(d, bounds) for d in dims.split(",") if d), DType(dt))


def parse_symbols(text: str | None) -> Bounds:
    """``batch in [1, 8], seq in [1, 512]`` → the symbols' ranges."""
    out = []
    for part in _split_top(text or ""):
        m = _SYM.fullmatch(part)
        if not m:
            raise ParseError(f"cannot read the symbol declaration {part!r} (expected 'NAME in [MIN, MAX]')")
        out.append((m["name"], int(m["lo"]), int(m["hi"])))
    return tuple(sorted(out))


def _split_top(text: str) -> list[str]:
    """Split on commas not nested inside [...] or a string."""
    parts, depth, cur, in_str, esc = [], 0, "", False, False
    for ch in text:
        if in_str:
            cur += ch
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def parse_attr(text: str, bounds: Bounds = ()) -> object:
    text = text.strip()
    if text.startswith("["):
        return tuple(parse_attr(x, bounds) for x in _split_top(text[1:-1]))
    if text.startswith('"'):
        return json.loads(text)
    if text in ("true", "false"):
        return text == "true"
    if text in {d.value for d in DType}:
        return DType(text)
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if bounds and not _FLOAT.fullmatch(text):
        return parse_dim(text, bounds)
    return float(text)


def parse_graph(text: str, params: Mapping[str, torch.Tensor] | None = None) -> Graph:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip() and not ln.strip().startswith("//")]
    if not lines:
        raise ParseError("empty text")
    m = _HEADER.match(lines[0])
    if not m:
        raise ParseError(f"line 1: expected 'graph @name(...) {{', got {lines[0]!r}")
    try:
        bounds = parse_symbols(m["syms"])
    except (ParseError, SymbolicShapeError) as e:
        raise ParseError(f"line 1: {e}") from None
    env: dict[str, Node] = {}
    nodes: list[Node] = []
    inputs: list[Node] = []
    for i, arg in enumerate(_split_top(m["args"])):
        name, _, ty = arg.partition(": ")
        t = _type_at(ty, bounds, 1)
        node = make_node("input", (), {"name": name.lstrip("%"), "index": i, "shape": t.shape, "dtype": t.dtype})
        env[name] = node
        nodes.append(node)
        inputs.append(node)
    outputs: tuple[Node, ...] | None = None
    constants: tuple = ()
    param_tensors: dict[str, torch.Tensor] = {}
    updates: list[tuple[Node, Node, str, str]] = []
    seed: int | None = None
    for lineno, line in enumerate(lines[1:], start=2):
        if line == "}":
            break
        if r := _RETURN.match(line):
            returned = [o.strip() for o in r["outs"].split(",") if o.strip()]
            constants = tuple((k, None if o == "none" else parse_attr(o)) for k, o in enumerate(returned)
                              if not o.startswith("%"))
            outputs = tuple(_lookup(env, o, lineno) for o in returned if o.startswith("%"))
            continue
        if u := _UPDATE.match(line):
            dst, src = _lookup(env, u["dst"], lineno), _lookup(env, u["src"], lineno)
            if dst.op != "input":
                raise ParseError(f"line {lineno}: {u['dst']} is not a graph input (only inputs are updated)")
            updates.append((dst, src, u["kind"], json.loads(u["target"])))
            continue
        if sd := _SEED.match(line):
            node = _lookup(env, sd["src"], lineno)
            if node.op != "input" or node.type.rank or node.dtype.value != "i64":
                raise ParseError(f"line {lineno}: the seed {sd['src']} must be an i64[] graph input")
            seed = node.attr("index")
            continue
        nm = _NODE.match(line)
        if not nm:
            raise ParseError(f"line {lineno}: cannot parse {line!r}")
        op = nm["op"]
        operands = [_lookup(env, o.strip(), lineno) for o in nm["ops"].split(",") if o.strip()]
        attrs: dict[str, object] = {}
        for item in _split_top(nm["attrs"] or ""):
            k, _, v = item.partition("=")
            try:
                attrs[k.strip()] = parse_attr(v, bounds)
            except SymbolicShapeError as e:
                raise ParseError(f"line {lineno}: {e}") from None
        t = _type_at(nm["type"], bounds, lineno)
        if op in SOURCES or op in ("extern", "random"):
            attrs.update(shape=t.shape, dtype=t.dtype)
        if op == "cast":
            attrs["dtype"] = t.dtype
        loc = json.loads(nm["loc"]) if nm["loc"] else None
        try:
            node = make_node(op, operands, attrs, loc)
        except IRTypeError as e:
            raise ParseError(f"line {lineno}: {e}") from None
        if node.type != t:
            raise ParseError(f"line {lineno}: printed type {t} but the op gives {node.type}")
        if op == "param":
            name = attrs["name"]
            if params is not None and name in params:
                param_tensors[name] = params[name]
            else:
                param_tensors[name] = torch.zeros(t.shape, dtype=t.dtype.torch)
        env[nm["res"]] = node
        nodes.append(node)
    if outputs is None:
        raise ParseError("missing 'return (...)'")
    mutations = []
    for dst, src, kind, target in updates:  # the new values follow the returned ones
        mutations.append(Mutation(len(outputs), dst.attr("index"), target, kind))
        outputs += (src,)
    return Graph(m["name"], tuple(nodes), tuple(inputs), outputs, param_tensors, mutations=tuple(mutations),
                 constant_outputs=constants, seed=seed)


def _type_at(text: str, bounds: Bounds, lineno: int) -> TensorType:
    try:
        return parse_type(text, bounds)
    except SymbolicShapeError as e:
        raise ParseError(f"line {lineno}: {e}") from None


def _lookup(env: dict[str, Node], name: str, lineno: int) -> Node:
    try:
        return env[name]
    except KeyError:
        raise ParseError(f"line {lineno}: {name} used before it is defined") from None
