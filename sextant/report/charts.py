"""Inline SVG charts for the report: the roofline plot and where predicted time goes."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

from sextant.graph.dtypes import DType
from sextant.report.graph_svg import KIND_COLORS
from sextant.report.roofline import Estimate, GpuSpec, KernelTotal

W, H, LEFT, BOTTOM, TOP, RIGHT = 720, 420, 70, 48, 16, 20


def _esc(s: object) -> str:
    return html.escape(str(s), quote=True)


def si(value: float, unit: str) -> str:
    """``1.5e12, "FLOP/s"`` → ``"1.50 TFLOP/s"``."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def seconds(t: float) -> str:
    return f"{t * 1e6:.2f} µs" if t < 1e-3 else f"{t * 1e3:.3g} ms"


def roofline_svg(estimates: Sequence[Estimate], gpu: GpuSpec) -> str:
    """Log-log roofline of ``gpu`` (fp32 CUDA-core roof, memory roof) with one point per launch at
    its arithmetic intensity and predicted FLOP/s (launch overhead included, so small launches sit
    well below the roofs). Launches with no FLOPs (pure data movement) cannot be placed."""
    pts = [e for e in estimates if e.cost.flops > 0 and e.cost.bytes > 0]
    peak = gpu.peak_flops(DType.f32)
    xs = [e.cost.intensity for e in pts] + [gpu.ridge()]
    ys = [e.cost.flops / e.time_s for e in pts] + [peak]
    x_lo, x_hi = math.floor(math.log10(min(xs))) - 1, math.ceil(math.log10(max(xs))) + 1
    y_lo, y_hi = math.floor(math.log10(min(ys))) - 1, math.ceil(math.log10(peak)) + 1

    def px(x: float) -> float:
        return LEFT + (math.log10(x) - x_lo) / (x_hi - x_lo) * (W - LEFT - RIGHT)

    def py(y: float) -> float:
        return H - BOTTOM - (math.log10(y) - y_lo) / (y_hi - y_lo) * (H - BOTTOM - TOP)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" class="roofline" width="{W}" height="{H}" '
           f'viewBox="0 0 {W} {H}" role="img" aria-label="roofline plot for {_esc(gpu.name)}">']
    for e in range(x_lo, x_hi + 1):
        x = px(10.0**e)
        out.append(f'<line class="grid" x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{H - BOTTOM}"/>'
                   f'<text class="tick" x="{x:.1f}" y="{H - BOTTOM + 16}">1e{e}</text>')
    for e in range(y_lo, y_hi + 1):
        y = py(10.0**e)
        out.append(f'<line class="grid" x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}"/>'
                   f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                   f'{_esc(si(10.0**e, ""))}</text>')
    out.append(f'<text class="axis" x="{(LEFT + W - RIGHT) / 2}" y="{H - 10}">arithmetic intensity (FLOP/byte)</text>'
               f'<text class="axis" transform="rotate(-90)" x="{-(TOP + H - BOTTOM) / 2}" y="16">FLOP/s</text>')
    ridge = gpu.ridge()
    x0 = 10.0**x_lo
    out.append(f'<polyline class="roof" points="{px(x0):.1f},{py(x0 * gpu.bandwidth):.1f} {px(ridge):.1f},'
               f'{py(peak):.1f} {px(10.0**x_hi):.1f},{py(peak):.1f}"/>'
               f'<text class="roof-label" x="{W - RIGHT:.1f}" y="{py(peak) - 6:.1f}" text-anchor="end">fp32 CUDA '
               f'cores {_esc(si(peak, "FLOP/s"))}</text>'
               f'<text class="roof-label" x="{px(ridge) + 6:.1f}" y="{py(peak) + 14:.1f}">ridge {ridge:.1f} FLOP/B'
               f'</text>'
               f'<text class="roof-label" x="{px(x0) + 6:.1f}" y="{py(x0 * gpu.bandwidth) - 8:.1f}">'
               f'{_esc(si(gpu.bandwidth, "B/s"))}</text>')
    for e in pts:
        c = e.cost
        tip = (f"#{c.launch} {c.kernel}: {c.intensity:.2f} FLOP/B, predicted {si(c.flops / e.time_s, 'FLOP/s')} "
               f"({seconds(e.time_s)}, {e.bound}-bound)")
        out.append(f'<a href="#launch-{c.launch}"><circle class="pt" cx="{px(c.intensity):.1f}" '
                   f'cy="{py(c.flops / e.time_s):.1f}" r="5" fill="{KIND_COLORS.get(c.kind, "#666")}">'
                   f'<title>{_esc(tip)}</title></circle></a>')
    out.append("</svg>")
    return "\n".join(out)


def time_bars(rows: Sequence[KernelTotal]) -> str:
    """A table row per kernel with a bar of its share of predicted time (overhead part hatched)."""
    top = max((r.time_s for r in rows), default=0) or 1
    out = ['<table class="bars"><thead><tr><th>kernel</th><th>kind</th><th>launches</th><th>predicted</th>'
           '<th>share</th><th>bound</th><th class="barcol">time (launch overhead lighter)</th></tr></thead><tbody>']
    for r in rows:
        work = (r.time_s - r.overhead_s) / top * 100
        over = r.overhead_s / top * 100
        color = KIND_COLORS.get(r.kind, "#666")
        out.append(f'<tr><td><a href="#kernel-{_esc(r.kernel)}">{_esc(r.kernel)}</a></td><td>{_esc(r.kind)}</td>'
                   f'<td class="num">{r.launches}</td><td class="num">{seconds(r.time_s)}</td>'
                   f'<td class="num">{r.share * 100:.1f}%</td><td>{_esc(r.bound)}</td>'
                   f'<td class="barcol"><span class="bar" style="width:{work:.2f}%;background:{color}"></span>'
                   f'<span class="bar overhead" style="width:{over:.2f}%;background:{color}"></span></td></tr>')
    out.append("</tbody></table>")
    return "\n".join(out)
