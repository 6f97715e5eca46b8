"""ptxas under each kernel's register budget, relaxed for a kernel the budget makes spill.

A mapping records ``max_registers`` (emitted as ``.maxnreg``) when its occupancy estimate assumes
that many registers per thread. What gets fused into the kernel can need more: GPT-2's attention
loads its causal mask and scales the logits inside the flash kernel, and under its 128-register
budget ptxas spilled 152 B per thread, where on its own it takes 167 registers and spills
nothing. Local-memory traffic in the inner loop costs more than the block per SM the budget buys,
so a kernel that spills at its budget is assembled again with ptxas choosing, and keeps whichever
allocation spills less. Kernels that do not spill are left alone (one ptxas run, as before).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sextant.codegen.llvm_nvptx import PtxModule, emit_ptx
from sextant.codegen.ptxas import KernelResources, PtxasResult, assemble
from sextant.kernel.ir import Kernel

Assembler = Callable[[str, str], PtxasResult]


def spill_bytes(r: KernelResources) -> int:
    return r.spill_stores + r.spill_loads


def _unbudgeted(k: Kernel, spilled: KernelResources) -> Kernel:
    meta = {**k.meta, "max_registers": None,
            "register_budget": f"relaxed: spilled {spill_bytes(spilled)} B at .maxnreg {k.meta['max_registers']}"}
    return dataclasses.replace(k, meta=meta)


def relax_spilling(kernels: list[Kernel], ptx: PtxModule, res: PtxasResult,
                   assembler: Assembler = assemble) -> tuple[list[Kernel], PtxModule, PtxasResult, list[str]]:
    """``ptx`` (emitted from ``kernels``) and ``res`` (ptxas's result for it), redone without the
    budget of each kernel that spilled under it where that spills less. Returns the kernels as
    finally emitted (a relaxed one has ``max_registers`` None and says why in
    ``meta["register_budget"]``), their PTX and cubin, and one note per relaxed kernel."""
    arch = ptx.arch
    spilled = {k.name: res.kernels[k.name] for k in kernels
               if k.meta.get("max_registers") and k.name in res.kernels and spill_bytes(res.kernels[k.name])}
    if not spilled:
        return kernels, ptx, res, []
    trial = [_unbudgeted(k, spilled[k.name]) if k.name in spilled else k for k in kernels]
    ptx2 = emit_ptx(trial, arch=arch)
    res2 = assembler(ptx2.ptx, arch)
    better = {n for n, r in spilled.items() if spill_bytes(res2.kernels[n]) < spill_bytes(r)}
    notes = [f"register budget: {n} spilled {spill_bytes(r)} B at .maxnreg "
             f"{next(k for k in kernels if k.name == n).meta['max_registers']}; ptxas's own allocation "
             f"({res2.kernels[n].registers} registers, {spill_bytes(res2.kernels[n])} B spills) kept"
             for n, r in spilled.items() if n in better]
    if better == set(spilled):
        return trial, ptx2, res2, notes
    if not better:
        return kernels, ptx, res, []
    final = [_unbudgeted(k, spilled[k.name]) if k.name in better else k for k in kernels]
    ptx3 = emit_ptx(final, arch=arch)
    return final, ptx3, assembler(ptx3.ptx, arch), notes
