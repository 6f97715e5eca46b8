"""The model's graph as inline SVG, each fused kernel launch drawn as an outlined box of its ops.

Layout is computed here, in two levels, because a browser page must not fetch a layout library:
launches are placed in layers by their data dependences (a launch sits below every launch whose
output it reads); inside a box the ops are placed in rows by their depth within the kernel. Pure
re-indexing ops (reshape, permute, expand, slice) and constants are not drawn — they are index
arithmetic in the kernel — and edges run through them. Clicking a box jumps to its launch.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass, field

from sextant.graph.ir import Node
from sextant.report.cost import split_args
from sextant.report.roofline import Estimate
from sextant.report.sources import source_line
from sextant.schedule.program import Program

HIDDEN_OPS = frozenset({"reshape", "permute", "expand", "slice", "full", "iota"})
KIND_COLORS = {"matmul": "#3b6fd8", "conv": "#8a4fd0", "reduce": "#e07b22", "elementwise": "#2e9b57",
               "attention": "#c23b6e"}
NODE_H, ROW_GAP, COL_GAP, PAD, HEADER = 22, 14, 8, 10, 24
BOX_GAP_X, LAYER_GAP, CHAR_W = 40, 40, 7


def op_label(n: Node) -> str:
    if n.op == "reduce":
        return f"reduce {n.attr('fn')}"
    return n.op


@dataclass
class _Box:
    launch: int
    kind: str
    title: str
    rows: list[list[Node]]
    width: float = 0
    height: float = 0
    x: float = 0
    y: float = 0
    pos: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # id(node) -> x, y, w (local)
    parents: dict[int, list[Node]] = field(default_factory=dict)


def _node_w(n: Node) -> float:
    return CHAR_W * len(op_label(n)) + 14


def _box(program: Program, li: int, est: Estimate | None) -> _Box:
    launch = program.launches[li]
    group = program.groups[launch.group]
    nodes = program.computed_nodes(launch)
    inside = {id(n) for n in nodes}
    drawn = [n for n in nodes if n.op not in HIDDEN_OPS] or list(group.outputs)
    shown = {id(n) for n in drawn}

    def drawn_parents(n: Node) -> list[Node]:
        out, stack, seen = [], list(n.inputs), set()
        while stack:
            p = stack.pop()
            if id(p) in seen or id(p) not in inside:
                continue
            seen.add(id(p))
            if id(p) in shown:
                out.append(p)
            else:
                stack.extend(p.inputs)
        return out

    parents = {id(n): drawn_parents(n) for n in drawn}
    depth: dict[int, int] = {}
    for n in drawn:  # graph order is topological
        depth[id(n)] = 1 + max((depth[id(p)] for p in parents[id(n)]), default=-1)
    rows: list[list[Node]] = [[] for _ in range(max(depth.values()) + 1)]
    column: dict[int, float] = {}
    for n in drawn:
        rows[depth[id(n)]].append(n)
    for row in rows:  # order each row by its parents' mean column: fewer crossings
        row.sort(key=lambda n: sum(column[id(p)] for p in parents[id(n)]) / max(len(parents[id(n)]), 1))
        for i, n in enumerate(row):
            column[id(n)] = i
    time = f" · {est.time_s * 1e6:.1f} µs" if est else ""
    box = _Box(li, group.kind, f"#{li} {launch.kernel} · {group.kind}{time}", rows, parents=parents)
    widths = [sum(_node_w(n) for n in row) + COL_GAP * (len(row) - 1) for row in rows]
    box.width = max(max(widths), CHAR_W * len(box.title) + 2 * PAD) + 2 * PAD
    for r, (row, w) in enumerate(zip(rows, widths)):
        x = (box.width - w) / 2
        for n in row:
            box.pos[id(n)] = (x, HEADER + PAD + r * (NODE_H + ROW_GAP), _node_w(n))
            x += _node_w(n) + COL_GAP
    box.height = HEADER + 2 * PAD + len(rows) * (NODE_H + ROW_GAP) - ROW_GAP
    return box


def _esc(s: object) -> str:
    return html.escape(str(s), quote=True)


def _node_tooltip(n: Node) -> str:
    text = f"{n.op} : {n.type}"
    if n.loc:
        src = source_line(n.loc)
        text += f"\n{n.loc}" + (f"  {src.code}" if src.code else "")
    return text


def graph_svg(program: Program, estimates: Sequence[Estimate] | None = None) -> str:
    """An ``<svg>`` element drawing ``program``'s launches (boxes, linked to ``#launch-N``) and data flow."""
    boxes = [_box(program, li, estimates[li] if estimates else None) for li in range(len(program.launches))]
    writer: dict[int, int] = {}  # buffer -> launch writing it
    layer: dict[int, int] = {}
    edges: dict[tuple[str, str], list[str]] = {}  # (from, to) -> buffer types
    for li, launch in enumerate(program.launches):
        reads, writes = split_args(program, launch)
        layer[li] = 1 + max((layer[writer[b]] for b in reads if b in writer), default=0)
        for b in dict.fromkeys(reads):
            buf = program.buffers[b]
            src = f"L{writer[b]}" if b in writer else f"I{b}" if buf.kind == "input" else None
            if src is not None:
                edges.setdefault((src, f"L{li}"), []).append(str(buf.node.type))
        for b in writes:
            writer[b] = li
    inputs = [b.index for b in program.buffers if b.kind == "input"]
    out_layer = max(layer.values(), default=0) + 1
    for k, b in enumerate(program.outputs):
        if b in writer:
            edges.setdefault((f"L{writer[b]}", f"O{k}"), []).append(str(program.buffers[b].node.type))

    # place: layer 0 the graph inputs, then launches, then the outputs
    pill = {f"I{b}": (f"input {program.buffers[b].node.attr('name')}", 0) for b in inputs}
    pill |= {f"O{k}": (f"output {k}", out_layer) for k in range(len(program.outputs))}
    items: dict[str, list[float]] = {}  # id -> [x, y, w, h]
    by_layer: dict[int, list[str]] = {}
    for key, (label, lay) in pill.items():
        items[key] = [0, 0, CHAR_W * len(label) + 24, NODE_H + 6]
        by_layer.setdefault(lay, []).append(key)
    for b in boxes:
        items[f"L{b.launch}"] = [0, 0, b.width, b.height]
        by_layer.setdefault(layer[b.launch], []).append(f"L{b.launch}")
    row_w = {lay: sum(items[k][2] for k in ks) + BOX_GAP_X * (len(ks) - 1) for lay, ks in by_layer.items()}
    width = max(row_w.values()) + 2 * BOX_GAP_X + 60  # room on the right for edges that skip layers
    y = PAD
    for lay in sorted(by_layer):
        x = (width - 60 - row_w[lay]) / 2
        for k in by_layer[lay]:
            items[k][0], items[k][1] = x, y
            x += items[k][2] + BOX_GAP_X
        y += max(items[k][3] for k in by_layer[lay]) + LAYER_GAP
    height = y - LAYER_GAP + PAD
    layer_of = {k: lay for lay, ks in by_layer.items() for k in ks}

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="graph" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="fused kernel graph">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
           'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#777"/></marker></defs>']
    side = 0
    for (a, b), types in edges.items():
        ax, ay, aw, ah = items[a]
        bx, by_, bw, _ = items[b]
        x0, y0, x1, y1 = ax + aw / 2, ay + ah, bx + bw / 2, by_
        if layer_of[b] - layer_of[a] > 1:  # skip the layers between: run down the right-hand side
            side += 1
            xr = width - 50 + (side % 6) * 7
            d = (f"M{x0:.1f},{y0:.1f} C{x0:.1f},{y0 + 20:.1f} {xr:.1f},{y0:.1f} {xr:.1f},{y0 + 24:.1f} "
                 f"L{xr:.1f},{y1 - 24:.1f} C{xr:.1f},{y1:.1f} {x1:.1f},{y1 - 20:.1f} {x1:.1f},{y1:.1f}")
        else:
            d = f"M{x0:.1f},{y0:.1f} C{x0:.1f},{(y0 + y1) / 2:.1f} {x1:.1f},{(y0 + y1) / 2:.1f} {x1:.1f},{y1:.1f}"
        out.append(f'<path class="edge" d="{d}" marker-end="url(#arrow)">'
                   f'<title>{_esc(", ".join(types))}</title></path>')
    for key, (label, _) in pill.items():
        x, y, w, h = items[key]
        out.append(f'<g class="pill"><rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="{h / 2:.1f}"/>'
                   f'<text x="{x + w / 2:.1f}" y="{y + h / 2 + 4:.1f}">{_esc(label)}</text></g>')
    for box in boxes:
        x, y, w, h = items[f"L{box.launch}"]
        color = KIND_COLORS.get(box.kind, "#666")
        out.append(f'<a href="#launch-{box.launch}" class="group" data-launch="{box.launch}">'
                   f'<title>{_esc(box.title)} (click for the kernel)</title>'
                   f'<rect class="box" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="6" '
                   f'stroke="{color}" fill="{color}1a"/>'
                   f'<text class="box-title" x="{x + PAD:.1f}" y="{y + 16:.1f}" fill="{color}">'
                   f'{_esc(box.title)}</text>')
        for row in box.rows:
            for n in row:
                for p in box.parents[id(n)]:
                    px, py, pw = box.pos[id(p)]
                    nx, ny, nw = box.pos[id(n)]
                    out.append(f'<line class="op-edge" x1="{x + px + pw / 2:.1f}" y1="{y + py + NODE_H:.1f}" '
                               f'x2="{x + nx + nw / 2:.1f}" y2="{y + ny:.1f}"/>')
        for row in box.rows:
            for n in row:
                nx, ny, nw = box.pos[id(n)]
                out.append(f'<g class="op"><title>{_esc(_node_tooltip(n))}</title>'
                           f'<rect x="{x + nx:.1f}" y="{y + ny:.1f}" width="{nw:.1f}" height="{NODE_H}" rx="3"/>'
                           f'<text x="{x + nx + nw / 2:.1f}" y="{y + ny + 15:.1f}">{_esc(op_label(n))}</text></g>')
        out.append("</a>")
    out.append("</svg>")
    return "\n".join(out)
