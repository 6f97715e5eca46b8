"""``--dump STAGES -o DIR``: every requested stage written to DIR, one file per stage (per kernel
where it applies), and an ``index.md`` listing them, so a compilation can be read file by file
and diffed between two versions of sextant or of the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sextant.cli.build import Build
from sextant.cli.errors import CliError, ExitCode
from sextant.codegen.llvm_nvptx import ptx_entry_spans
from sextant.codegen.sass import MISSING, disassemble, find_disassembler, split_sass
from sextant.graph.printer import print_graph
from sextant.kernel.printer import print_kernel

STAGES = ("graph", "passes", "schedule", "kernel", "llvm", "ptx", "sass")
_GPU_ONLY = ("ptx", "sass")


@dataclass(frozen=True)
class DumpEntry:
    stage: str
    path: str  # relative to the dump folder
    what: str


def parse_stages(text: str) -> list[str]:
    """``all`` or a comma-separated list of stage names, in pipeline order."""
    names = {s.strip() for s in text.split(",") if s.strip()}
    if "all" in names:
        return list(STAGES)
    unknown = sorted(names - set(STAGES))
    if unknown or not names:
        raise CliError(f"unknown --dump stage(s): {', '.join(unknown) or repr(text)}",
                       f"stages: {', '.join(STAGES)}, or all", ExitCode.USAGE)
    return [s for s in STAGES if s in names]


def split_ptx(ptx: str) -> tuple[str, dict[str, str]]:
    """(module-level text, {kernel: its ``.entry``}): prelude + one entry is a PTX file ptxas accepts."""
    lines = ptx.splitlines()
    spans = ptx_entry_spans(ptx)
    inside = {i for a, b in spans.values() for i in range(a, b)}
    prelude = [line for i, line in enumerate(lines) if i not in inside and not line.lstrip().startswith("// .globl")]
    entries = {name: "\n".join(lines[a:b]) + "\n" for name, (a, b) in spans.items()}
    return "\n".join(prelude).rstrip() + "\n", entries


class _Writer:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.entries: list[DumpEntry] = []

    def write(self, stage: str, rel: str, text: str, what: str) -> None:
        path = self.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text if text.endswith("\n") else text + "\n")
        self.entries.append(DumpEntry(stage, rel, what))


def _kernel_what(build: Build, name: str) -> str:
    program = build.compiled.stages["program"]
    k = program.kernels[name]
    launches = [(i, launch) for i, launch in enumerate(program.launches) if launch.kernel == name]
    kind = program.groups[launches[0][1].group].kind if launches else "unused"
    return (f"{kind} kernel, grid {k.grid}, block {k.block}; launches "
            f"{', '.join(f'#{i}' for i, _ in launches) or 'none'}")


def write_dump(build: Build, out: Path, stages: Iterable[str], command: str = "") -> tuple[list[DumpEntry], list[str]]:
    """Write ``stages`` of ``build`` under ``out``; returns the files written and notes on stages
    skipped (with the reason)."""
    stages = list(stages)
    out.mkdir(parents=True, exist_ok=True)
    w = _Writer(out)
    notes: list[str] = []
    st = build.compiled.stages
    program = st.get("program")
    for stage in stages:
        if stage in _GPU_ONLY and not build.is_gpu:
            notes.append(f"{stage} skipped: target {build.target} generates no GPU code (use --target cuda-sim)")
            continue
        if stage == "graph":
            w.write("graph", "graph.txt", print_graph(st["captured"]), "graph IR as captured (torch.export + lowering)")
            w.write("graph", "graph.optimized.txt", print_graph(build.compiled.graph), "graph IR after the passes")
        elif stage == "passes":
            for i, r in enumerate(build.trace, 1):
                change = f"{r.nodes_before} -> {r.nodes_after} nodes" if r.changed else "no change"
                w.write("passes", f"passes/{i:02d}-{r.name}.txt", print_graph(r.graph),
                        f"graph IR after pass run {i}, {r.name} ({change})")
        elif stage == "schedule":
            w.write("schedule", "schedule.txt", program.describe(), "fused kernels, launches, buffers, refused fusions")
        elif stage == "kernel":
            for name, k in program.kernels.items():
                w.write("kernel", f"kernel/{name}.kir", print_kernel(k), _kernel_what(build, name))
        elif stage == "llvm":
            _write_llvm(w, build)
        elif stage == "ptx":
            ptx = st["ptx"]
            w.write("ptx", "ptx/module.ptx", ptx.ptx, f"the whole PTX module ({ptx.arch}), as ptxas assembled it")
            prelude, entries = split_ptx(ptx.ptx)
            for name, entry in entries.items():
                w.write("ptx", f"ptx/{name}.ptx", prelude + "\n" + entry, f"kernel {name} (assembles on its own)")
        elif stage == "sass":
            notes += _write_sass(w, build)
    _write_index(out, build, w.entries, notes, command)
    return w.entries, notes


def _write_llvm(w: _Writer, build: Build) -> None:
    st = build.compiled.stages
    if "ptx" in st:
        w.write("llvm", "llvm/nvptx.ll", st["ptx"].llvm_ir, "NVPTX LLVM IR as lowered from the kernel IR")
        w.write("llvm", "llvm/nvptx.opt.ll", st["ptx"].optimized_ir, "NVPTX LLVM IR after libdevice linking and O3")
    cpu = st.get("cpu_module")
    if cpu is not None:
        how = "the SIMT lowering that runs the GPU kernels on the CPU" if build.is_gpu else "the CPU kernels"
        w.write("llvm", "llvm/cpu.ll", cpu.llvm_ir, f"x86 LLVM IR of {how}")
        w.write("llvm", "llvm/cpu.opt.ll", cpu.optimized_ir, "x86 LLVM IR after O3 (what the JIT compiles)")


def _write_sass(w: _Writer, build: Build) -> list[str]:
    tool = find_disassembler()
    if tool is None:
        return [f"sass skipped: {MISSING}"]
    cubin = build.compiled.stages["ptxas"].cubin
    try:
        text = disassemble(cubin, tool)
    except (RuntimeError, OSError) as e:
        return [f"sass skipped: {e}"]
    arch = build.compiled.stages["ptxas"].arch
    w.write("sass", "sass/module.sass", text, f"SASS of the whole cubin ({arch}, by {tool.name})")
    names = list(build.compiled.stages["program"].kernels)
    for name, part in split_sass(text, names).items():
        w.write("sass", f"sass/{name}.sass", part, f"kernel {name}")
    return []


def _write_index(out: Path, build: Build, entries: list[DumpEntry], notes: list[str], command: str) -> None:
    m = build.model
    lines = [f"# sextant dump: {m.name}", ""]
    if command:
        lines += [f"`{command}`", ""]
    target = build.target + (f" ({build.arch})" if build.is_gpu else "")
    lines += [f"- model: {type(m.module).__name__}, {m.num_params:,} parameters",
              f"- target: {target}" + (f" (asked for {build.requested_target})"
                                        if build.requested_target != build.target else ""),
              f"- pipeline: {build.pipeline if isinstance(build.pipeline, str) else ','.join(build.pipeline)}"]
    lines += [f"- note: {n}" for n in build.notes + notes]
    lines += ["", "| stage | file | what |", "|---|---|---|"]
    lines += [f"| {e.stage} | [{e.path}]({e.path}) | {e.what} |" for e in entries]
    (out / "index.md").write_text("\n".join(lines) + "\n")
