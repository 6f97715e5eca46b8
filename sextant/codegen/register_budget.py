"""ptxas under each kernel's register budget, lifted for a kernel the budget makes spill.

A mapping records ``max_registers`` (emitted as ``.maxnreg``) when its occupancy estimate assumes
that many registers per thread. What gets fused into the kernel can need more: GPT-2's attention
loads its causal mask and scales the logits inside the flash kernel, and under its 128-register
budget ptxas spilled ~150 B per thread, where on its own it takes 167 registers and spills
nothing. Local-memory traffic in the inner loop costs more than the block per SM the budget buys,
so a kernel that spills at its budget is assembled again without it and keeps whichever
allocation spills less.

``.maxnreg`` is a directive for ptxas only (LLVM's PTX uses virtual registers whatever the
budget), so lifting it is deleting that line of the kernel's ``.entry`` header: no re-emission,
one more ptxas run, and only when something spilled. (The module's ``llvm_ir`` still shows the
``maxnreg`` annotation it was lowered with; the kernel's ``meta`` says the budget was lifted.)
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable

from sextant.codegen.llvm_nvptx import PtxModule
from sextant.codegen.ptxas import KernelResources, PtxasResult, assemble
from sextant.kernel.ir import Kernel

Assembler = Callable[[str, str], PtxasResult]
_MAXNREG = re.compile(r"^\.maxnreg \d+\n", re.M)


def spill_bytes(r: KernelResources) -> int:
    return r.spill_stores + r.spill_loads


def without_budget(ptx: str, names: Iterable[str]) -> str:
    """``ptx`` with the ``.maxnreg`` directive of each ``.entry`` in ``names`` deleted."""
    for name in names:
        start = ptx.index(f".entry {name}(")
        body = ptx.index("{", start)
        ptx = ptx[:start] + _MAXNREG.sub("", ptx[start:body]) + ptx[body:]
    return ptx


def relax_spilling(kernels: list[Kernel], ptx: PtxModule, res: PtxasResult,
                   assembler: Assembler = assemble) -> tuple[list[Kernel], PtxModule, PtxasResult, list[str]]:
    """``ptx`` (emitted from ``kernels``) and ``res`` (ptxas's result for it), with the budget of
    each kernel that spilled under it lifted where that spills less. Returns the kernels (a lifted
    one has ``max_registers`` None and says why in ``meta["register_budget"]``), the PTX, ptxas's
    result for it, and one note per lifted budget."""
    budgets = {k.name: k.meta.get("max_registers") for k in kernels}
    spilled = {n: r for n, r in res.kernels.items() if budgets.get(n) and spill_bytes(r)}
    if not spilled:
        return kernels, ptx, res, []
    trial = assembler(without_budget(ptx.ptx, spilled), ptx.arch)
    better = [n for n, r in spilled.items() if spill_bytes(trial.kernels[n]) < spill_bytes(r)]
    if not better:
        return kernels, ptx, res, []
    text = without_budget(ptx.ptx, better)
    final = trial if len(better) == len(spilled) else assembler(text, ptx.arch)
    notes = []
    out = []
    for k in kernels:
        if k.name in better:
            before, after = spilled[k.name], final.kernels[k.name]
            why = f"spilled {spill_bytes(before)} B at .maxnreg {budgets[k.name]}"
            notes.append(f"register budget: {k.name} {why}; ptxas's own allocation ({after.registers} registers, "
                         f"{spill_bytes(after)} B spills) kept")
            k = dataclasses.replace(k, meta={**k.meta, "max_registers": None, "register_budget": f"lifted: {why}"})
        out.append(k)
    return out, dataclasses.replace(ptx, ptx=text), final, notes
