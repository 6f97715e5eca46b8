"""The compile report: one self-contained HTML page (no network needed) for a compiled module.

It is meant to be read top-down by someone new to the compiler: where predicted GPU time goes,
the roofline, the graph with its fusion groups, every user source line and the kernels it ended
up in, then each kernel from its source ops through kernel IR, LLVM IR and PTX to SASS, with
ptxas's resource figures and a roofline estimate per launch. Styles and script are inlined from
``assets/``; every text is escaped.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from sextant.codegen.llvm_nvptx import ptx_entries
from sextant.graph.ir import Node
from sextant.graph.printer import print_graph
from sextant.kernel.printer import print_kernel
from sextant.kernel.shared_memory import block_shared_bytes
from sextant.report.charts import roofline_svg, seconds, si, time_bars
from sextant.report.cost import LaunchCost, program_costs
from sextant.report.graph_svg import HIDDEN_OPS, KIND_COLORS, graph_svg, op_label
from sextant.report.listings import llvm_functions, sass_functions
from sextant.report.roofline import GPUS, Estimate, GpuSpec, estimate, gpu_spec, kernel_totals, time_by_bound
from sextant.report.sources import source_line
from sextant.schedule.program import ExternCall, Program


def esc(s: object) -> str:
    return html.escape(str(s), quote=True)


def _asset(name: str) -> str:
    return resources.files("sextant.report").joinpath("assets", name).read_text(encoding="utf-8")


def _table(head: Sequence[str], rows: Sequence[Sequence[object]], num: Sequence[int] = ()) -> str:
    """A table of already-escaped cells; columns in ``num`` are right-aligned numbers."""
    th = "".join(f'<th{" class=num" if i in num else ""}>{h}</th>' for i, h in enumerate(head))
    body = "".join("<tr>" + "".join(f'<td{" class=num" if i in num else ""}>{c}</td>' for i, c in enumerate(r))
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def _listing(title: str, text: str | None, missing: str, *, open_: bool = False) -> str:
    if not text:
        return f'<p class="note">{esc(title)}: {esc(missing)}</p>'
    lines = text.count("\n") + 1
    return (f'<details{" open" if open_ else ""}><summary>{esc(title)} ({lines} lines)</summary>'
            f"<pre>{esc(text)}</pre></details>")


def _kind(kind: str) -> str:
    return f'<span class="kind" style="background:{KIND_COLORS.get(kind, "#666")}">{esc(kind)}</span>'


def _int(n: int) -> str:
    return f"{n:,}"


class _Report:
    def __init__(self, compiled: Any, gpu: str | GpuSpec, counters: dict[str, Any] | None = None):
        program = compiled.stages.get("program")
        if program is None:
            raise ValueError(f"no kernels to report: target {compiled.target!r} runs the graph IR op by op; "
                             "compile with target='cuda-sim' (or 'cpu') for a report")
        self.compiled = compiled
        self.counters = counters or {}  # cuda-sim's per-kernel counters (codegen.counters), when counted
        self.program: Program = program
        self.gpu = gpu_spec(gpu)
        self.costs = program_costs(program)
        self.estimates = [estimate(c, self.gpu) for c in self.costs]
        self.ptx = compiled.stages.get("ptx")
        self.ptxas = compiled.stages.get("ptxas")
        cpu = compiled.stages.get("cpu_module")
        source = self.ptx if self.ptx is not None else cpu
        self.lowered = llvm_functions(getattr(source, "llvm_ir", "") or "")
        self.optimized = llvm_functions(getattr(source, "optimized_ir", "") or "")
        self.entries = ptx_entries(self.ptx.ptx) if self.ptx is not None else {}
        self.sass: dict[str, str] | None = None
        self.sass_note = "no nvdisasm or cuobjdump found (pip install nvidia-cuda-nvdisasm)"
        if self.ptxas is not None:
            try:
                self.sass = sass_functions(self.ptxas.cubin)
            except (RuntimeError, OSError) as e:
                self.sass_note = f"disassembly failed: {e}"
        else:
            self.sass_note = "not a GPU target"

    # -- page -------------------------------------------------------------------------------
    def render(self) -> str:
        g = self.program.graph
        arch = f", {self.ptx.arch}" if self.ptx is not None else ""
        title = f"sextant report: @{g.name}"
        body = "\n".join([
            f"<header><h1>{esc(title)}</h1><div class=meta>target <b>{esc(self.compiled.target)}</b>{esc(arch)} · "
            f"{len(self.program.launches)} launches of {len(self.program.kernels)} unique kernels · "
            f"estimates for <b>{esc(self.gpu.name)}</b></div></header>",
            '<nav><a href="#summary">Summary</a><a href="#roofline">Roofline</a><a href="#graph">Graph</a>'
            '<a href="#sources">Source lines</a><a href="#kernels">Kernels</a><a href="#graph-ir">Graph IR</a>'
            '<button type=button data-details=open>expand all</button>'
            '<button type=button data-details=close>collapse all</button></nav>',
            "<main>", self.summary(), self.roofline(), self.graph(), self.sources(), self.externs(), self.kernels(),
            self.graph_ir(), "</main>",
        ])
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">'
                f"<title>{esc(title)}</title><style>{_asset('report.css')}</style></head>\n"
                f"<body>\n{body}\n<script>{_asset('report.js')}</script>\n</body></html>\n")

    # -- sections ---------------------------------------------------------------------------
    def summary(self) -> str:
        es, costs = self.estimates, self.costs
        total = sum(e.time_s for e in es)
        split = time_by_bound(es)
        facts = [
            ("launches / unique kernels", f"{len(es)} / {len(self.program.kernels)}"),
            ("FLOPs (see the cost model)", si(sum(c.flops for c in costs), "FLOP")),
            ("minimum memory traffic", si(sum(c.bytes for c in costs), "B")),
            (f"predicted time on {esc(self.gpu.name)}", seconds(total)),
            ("planned peak memory (intermediates + outputs)", si(self.program.peak_bytes, "B")),
        ]
        split_rows = [(esc(k), seconds(v), f"{v / total * 100:.1f}%" if total else "-") for k, v in split.items()]
        gpus = []
        for name, spec in GPUS.items():
            t = sum(estimate(c, spec).time_s for c in costs)
            gpus.append((esc(f"{name} ({spec.name})"), seconds(t), si(spec.fp32_flops, "FLOP/s"),
                         si(spec.bandwidth, "B/s"), spec.sms))
        launches = []
        for e in es:
            c = e.cost
            launches.append((f'<a href="#launch-{c.launch}">#{c.launch}</a>', esc(c.kernel), esc(c.kind),
                             c.blocks, si(c.flops, ""), si(c.bytes, "B"), f"{c.intensity:.2f}",
                             seconds(e.compute_s), seconds(e.memory_s), seconds(e.time_s), esc(e.bound)))
        return (
            '<section id="summary"><h2>Summary: where predicted time goes</h2>'
            + _table(("", ""), [(a, b) for a, b in facts])
            + '<p class="note">Predicted time per launch = max(FLOPs / compute peak, minimum bytes / memory '
              f"bandwidth) + {seconds(es[0].overhead_s) if es else '-'} launch overhead. The compute peak is the "
              "non-tensor (CUDA-core) rate, since sextant's kernels do not use tensor cores, scaled down when a "
              "launch has fewer blocks than the GPU has SMs. It is a lower bound: real kernels are slower.</p>"
            + "<h3>By kind of time</h3>" + _table(("", "predicted", "share"), split_rows, num=(1, 2))
            + "<h3>By kernel</h3>" + time_bars(kernel_totals(es))
            + "<h3>On each GPU</h3>"
            + _table(("GPU", "predicted total", "fp32 peak", "bandwidth", "SMs"), gpus, num=(1, 2, 3, 4))
            + "<details><summary>Every launch</summary>"
            + _table(("launch", "kernel", "kind", "blocks", "FLOPs", "min bytes", "FLOP/B", "compute", "memory",
                      "predicted", "bound"), launches, num=(3, 4, 5, 6, 7, 8, 9))
            + "</details></section>"
        )

    def roofline(self) -> str:
        return ('<section id="roofline"><h2>Roofline (' + esc(self.gpu.name) + ")</h2>"
                + roofline_svg(self.estimates, self.gpu)
                + '<p class="note">One point per launch, at its arithmetic intensity and the FLOP/s its predicted '
                  "time implies (launch overhead included, so short launches sit far below the roofs). Click a "
                  "point for its kernel. Launches with no FLOPs are not shown.</p></section>")

    def graph(self) -> str:
        legend = "".join(f'<span>{_kind(k)}</span>' for k in KIND_COLORS)
        return ('<section id="graph"><h2>Graph and fusion groups</h2>'
                f'<p class="legend">{legend}</p><p class="note">Each box is one kernel launch (a fusion group) with '
                f"the graph ops it computes; re-indexing ops ({', '.join(sorted(HIDDEN_OPS))}) are folded into "
                "indexing and not drawn. Arrows between boxes are buffers in memory. Hover an op for its type and "
                "source line; click a box to jump to its kernel.</p>"
                f'<div class="scroll">{graph_svg(self.program, self.estimates)}</div></section>')

    def _locs(self, nodes: Sequence[Node]) -> dict[str, list[Node]]:
        by_loc: dict[str, list[Node]] = {}
        for n in nodes:
            if n.op not in HIDDEN_OPS:
                by_loc.setdefault(n.loc or "(no source line)", []).append(n)
        return by_loc

    def sources(self) -> str:
        seen: dict[str, list[tuple[int, list[Node]]]] = {}
        for li, launch in enumerate(self.program.launches):
            for loc, nodes in self._locs(self.program.computed_nodes(launch)).items():
                seen.setdefault(loc, []).append((li, nodes))
        rows = []
        for loc, uses in seen.items():
            src = source_line(loc)
            where = "<br>".join(f'<a href="#launch-{li}">#{li} {esc(self.program.launches[li].kernel)}</a> '
                                f'<span class="mono">{esc(" ".join(op_label(n) for n in nodes))}</span>'
                                for li, nodes in uses)
            rows.append((f'<span class="mono" title="{esc(src.path or "")}">{esc(loc)}</span>',
                         f"<code>{esc(src.code)}</code>", where))
        return ('<section id="sources"><h2>Source lines → kernels</h2><p class="note">Every line of the model\'s '
                "Python source that produced an op, and the launches that compute those ops.</p>"
                + _table(("line", "code", "launches (ops)"), rows) + "</section>")

    def externs(self) -> str:
        """The ops sextant calls as themselves between its kernels (no lowering): op, line, buffers."""
        p = self.program
        rows = []
        for li, launch in enumerate(p.launches):
            if not isinstance(call := launch.extern, ExternCall):  # a kernel, or a collective
                continue
            src = source_line(call.loc) if call.loc else None
            types = lambda bs: ", ".join(str(p.buffers[b].node.type) for b in bs)
            rows.append((f'<span id="launch-{li}" class="mono">#{li} {esc(launch.kernel)}</span>',
                         f"<code>{esc(call.fn)}</code>", f'<span class="mono">{esc(call.loc or "?")}</span>',
                         f"<code>{esc(src.code if src else '')}</code>",
                         " → ".join(f"<code>{esc(types(bs))}</code>" for bs in call.split(launch.args))))
        if not rows:
            return ""
        return ('<section id="externs"><h2>Extern calls</h2><p class="note">Ops with no lowering in sextant, '
                "called as themselves on the host between kernels (fusion barriers; their work is not in the "
                "roofline). <code>strict=True</code> refuses them instead.</p>"
                + _table(("launch", "op", "line", "code", "operands → results"), rows) + "</section>")

    def kernels(self) -> str:
        parts = ['<section id="kernels"><h2>Kernels</h2>']
        launches_of: dict[str, list[int]] = {}
        for li, launch in enumerate(self.program.launches):
            launches_of.setdefault(launch.kernel, []).append(li)
        for name, k in self.program.kernels.items():
            parts.append(self.kernel(name, k, launches_of.get(name, [])))
        parts.append("</section>")
        return "\n".join(parts)

    def kernel(self, name: str, k: Any, launches: list[int]) -> str:
        kind = self.program.groups[self.program.launches[launches[0]].group].kind if launches else ""
        head = (f'<div class="kernel" id="kernel-{esc(name)}" data-kernel="{esc(name)}"><h3>{esc(name)} {_kind(kind)}'
                f"</h3><p>grid {esc(k.grid)} × block {esc(k.block)} = {_int(k.num_blocks * k.threads_per_block)} "
                f"threads; {len(launches)} launch{'es' if len(launches) != 1 else ''}: "
                + ", ".join(f'<a href="#launch-{li}">#{li}</a>' for li in launches) + "</p>")
        res = self.ptxas.kernels.get(name) if self.ptxas is not None else None
        if res is not None:
            head += _table(("ptxas " + esc(self.ptxas.arch), "registers", "shared memory", "spill stores",
                            "spill loads", "stack frame", "barriers"),
                           [("", res.registers, f"{block_shared_bytes(k, res.shared_bytes)} B", f"{res.spill_stores} B",
                             f"{res.spill_loads} B", f"{res.stack_frame} B", res.barriers)], num=(1, 2, 3, 4, 5, 6))
        counted = self.counters.get(name)
        if counted is not None:
            head += _table(("cuda-sim counters", "shared requests", "bank conflicts", "global loads coalesced",
                            "global stores coalesced", "MMA instructions", "tensor-core FLOPs"),
                           [("", _int(counted.shared_requests), _int(counted.bank_conflicts),
                             f"{counted.load_efficiency:.0%}", f"{counted.store_efficiency:.0%}",
                             _int(counted.mma_instructions), si(counted.mma_flops, ""))], num=(1, 2, 3, 4, 5, 6))
        body = [self.launch(li) for li in launches]
        listings = [
            _listing("Kernel IR", print_kernel(k), "-", open_=True),
            _listing("LLVM IR, as lowered", self.lowered.get(name), "not generated for this target"),
            _listing("LLVM IR, after O3 (input to the backend)", self.optimized.get(name),
                     "not generated for this target"),
            _listing("PTX", self.entries.get(name), "this target does not emit PTX"),
            _listing("SASS", (self.sass or {}).get(name), self.sass_note),
        ]
        return head + "\n".join(body) + "\n".join(listings) + "</div>"

    def launch(self, li: int) -> str:
        p = self.program
        launch = p.launches[li]
        e: Estimate = self.estimates[li]
        c: LaunchCost = e.cost
        k = p.kernels[launch.kernel]
        bufs = []
        for param, b in zip(k.params, launch.args):
            buf = p.buffers[b]
            what = buf.node.attr("name") if buf.node.op in ("param", "input") else f"%{buf.node.op}"
            bufs.append((f"<code>{esc(param.name)}</code>", esc(buf.kind), f"<code>{esc(buf.node.type)}</code>",
                         esc(what), esc(buf.node.loc or "")))
        ops = "; ".join(f"{esc(op)} {si(f, '')}" for op, f in c.flops_by_op.items()) or "none"
        cost = _table(("FLOPs", "bytes read", "bytes written", "FLOP/byte", "ridge", "compute", "memory", "overhead",
                       "predicted", "bound"),
                      [(si(c.flops, ""), si(c.bytes_read, "B"), si(c.bytes_written, "B"), f"{c.intensity:.2f}",
                        f"{e.ridge:.1f}", seconds(e.compute_s), seconds(e.memory_s), seconds(e.overhead_s),
                        f"<b>{seconds(e.time_s)}</b>", esc(e.bound))], num=tuple(range(9)))
        src_rows = []
        for loc, nodes in self._locs(p.computed_nodes(launch)).items():
            src = source_line(loc)
            src_rows.append((f'<span class="mono">{esc(loc)}</span>', f"<code>{esc(src.code)}</code>",
                             f'<span class="mono">{esc(" ".join(op_label(n) for n in nodes))}</span>'))
        return (f'<div class="launch" id="launch-{li}" data-launch="{li}"><h4>launch #{li} · {c.blocks} blocks · '
                f"{esc(e.gpu.name)} estimate {seconds(e.time_s)} ({esc(e.bound)}-bound)</h4>"
                + cost + f'<p class="note">FLOPs by op: {ops}. Compute peak here: {si(e.peak_flops, "FLOP/s")} '
                f"({e.sm_share * 100:.0f}% of the SMs).</p>"
                + "<h4>Source ops</h4>" + _table(("line", "code", "ops"), src_rows)
                + "<details><summary>Buffers</summary>"
                + _table(("parameter", "kind", "type", "value", "from"), bufs) + "</details></div>")

    def graph_ir(self) -> str:
        notes = "".join(f"<li>{esc(n)}</li>" for n in self.program.notes)
        rewrites = "".join(f"<li>{esc(n)}</li>" for n in self.program.rewrites)
        return ('<section id="graph-ir"><h2>Graph IR and schedule</h2>'
                + _listing("Graph IR after the pass pipeline", print_graph(self.compiled.graph), "-")
                + _listing("Schedule", self.program.describe(), "-")
                + (f"<h3>Rewrites</h3><ul>{rewrites}</ul>" if rewrites else "")
                + (f"<h3>Fusions refused</h3><ul>{notes}</ul>" if notes else "") + "</section>")


def render_report(compiled: Any, gpu: str | GpuSpec = "H100", counters: dict[str, Any] | None = None) -> str:
    """The report page for a :class:`~sextant.runtime.compiled.CompiledModule`, with roofline
    estimates for ``gpu`` (``"A100"``, ``"H100"``, ``"H200"``) and, given cuda-sim's
    ``counters`` (``runtime.counting.count_program``), each kernel's bank conflicts, coalescing
    and tensor-core instructions next to ptxas's figures."""
    return _Report(compiled, gpu, counters).render()


def write_report(compiled: Any, path: str | Path, gpu: str | GpuSpec = "H100",
                 counters: dict[str, Any] | None = None) -> Path:
    """Write :func:`render_report`'s page to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_report(compiled, gpu, counters), encoding="utf-8")
    return path
