"""Math on NVPTX: libdevice (CUDA's bitcode math library) plus the few intrinsics NVPTX selects.

LLVM's NVPTX backend has no lowering for ``llvm.exp``/``log``/``sin``/``pow`` and friends:
``llvm.exp.f32`` stops the *process* with a fatal error; and ``frem`` becomes the inexact
``x - trunc(x/y)*y``. So every C math function goes to libdevice's ``__nv_*`` (what
CUDA's own ``expf`` is), except those NVPTX turns into one exact instruction (``sqrt.rn``,
``abs``, ``cvt.rmi``, ``max.NaN``, ...), which stay intrinsics.

Linking: libdevice.10.bc is ~460 KB of bitcode (~350 functions, 55 ms to parse), so it is
parsed once per process: everything but the functions :class:`NvptxMath` can call is
internalised and global-DCE'd, and the remainder (~60 KB) is kept as bitcode (the *base*).
Each module links the base pruned to the set it calls (cached per set). libdevice's
``__nvvm_reflect`` queries are resolved by NVVMReflect, which the NVPTX target adds to the O3
pipeline (``__CUDA_FTZ`` = 0, set by the module flag: denormals are kept, as in torch).
"""

from __future__ import annotations

import importlib.util
import os
from collections import OrderedDict
from pathlib import Path

import llvmlite.binding as llvm
from llvmlite import ir

from sextant.codegen.errors import CodegenError
from sextant.codegen.scalar_math import LIBM_FUNCTIONS, MathLibrary, ScalarMath

PREFIX = "__nv_"
ENV_VAR = "SEXTANT_LIBDEVICE"
_DEFAULT_PATHS = ("/usr/local/cuda/nvvm/libdevice/libdevice.10.bc",)
_WHEEL_PATHS = ("cu13/nvvm/libdevice/libdevice.10.bc", "cuda_nvcc/nvvm/libdevice/libdevice.10.bc")
_CACHE_SIZE = 64

# C names NVPTX lowers exactly itself (one instruction, or a short expansion on old GPUs)
_INTRINSICS = {
    "sqrtf": "llvm.sqrt.f32", "fabsf": "llvm.fabs.f32", "floorf": "llvm.floor.f32", "ceilf": "llvm.ceil.f32",
    "truncf": "llvm.trunc.f32", "roundevenf": "llvm.roundeven.f32", "copysignf": "llvm.copysign.f32",
    "fmaximumf": "llvm.maximum.f32", "fminimumf": "llvm.minimum.f32", "trunc": "llvm.trunc.f64",
}


class NvptxMath(MathLibrary):
    """Safe intrinsics, else libdevice's ``__nv_NAME`` (declared here, linked by
    :func:`link_libdevice`). Never an LLVM math intrinsic NVPTX cannot select.

    ``native_bf16`` (sm_80 and later): f32 → bf16 is one ``cvt.rn.bf16.f32`` (inline PTX: the
    integer rounding sequence costs ~6 instructions and registers per value; ptxas gave a
    128×128 bf16 GEMM with a fused epilogue 184 registers with it, the f16 one 120). NaN becomes
    the canonical 0x7FFF instead of c10's 0x7FC0: both NaN."""

    def __init__(self, native_bf16: bool = False):
        self.native_bf16 = native_bf16

    def call(self, m: ScalarMath, name: str, args: list[ir.Value]) -> ir.Value:
        return m.call(_INTRINSICS.get(name, PREFIX + name), args[0].type, args)

    def round_bf16(self, m: ScalarMath, x: ir.Value) -> ir.Value | None:
        if not self.native_bf16 or x.type != ir.FloatType():
            return None
        fty = ir.FunctionType(ir.IntType(16), [ir.FloatType()])
        return m.b.asm(fty, "cvt.rn.bf16.f32 $0, $1;", "=h,f", [x], side_effect=False)


NVPTX_MATH = NvptxMath()
NVPTX_MATH_SM80 = NvptxMath(native_bf16=True)


def nvptx_math(sm: int) -> NvptxMath:
    """The math library for compute capability ``sm`` (e.g. 90)."""
    return NVPTX_MATH_SM80 if sm >= 80 else NVPTX_MATH
# what NvptxMath can ask libdevice for: the first base holds all of it (one parse per process)
EXPECTED = frozenset(PREFIX + n for n in LIBM_FUNCTIONS if n not in _INTRINSICS)


def find_libdevice() -> Path:
    """``$SEXTANT_LIBDEVICE``, the CUDA toolkit's (``$CUDA_HOME`` or /usr/local/cuda), or the one
    in PyPI's ``nvidia-nvvm`` (CUDA 13) / ``nvidia-cuda-nvcc-cu12`` wheels."""
    candidates = [os.environ.get(ENV_VAR, "")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "nvvm/libdevice/libdevice.10.bc"))
    candidates += _DEFAULT_PATHS
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidates += [os.path.join(root, rel) for rel in _WHEEL_PATHS]
    for c in candidates:
        if c and os.path.isfile(c):
            return Path(c)
    raise CodegenError(
        "libdevice.10.bc (CUDA's math library, needed for exp/log/sin/... on NVPTX) was not found; "
        f"set {ENV_VAR}, install the CUDA toolkit, or `pip install nvidia-nvvm`")


_pruned: OrderedDict[tuple[str, str, frozenset[str]], bytes] = OrderedDict()
_base: dict[tuple[str, str], tuple[frozenset[str], bytes]] = {}  # every function asked for so far


def _prune(bitcode: bytes, names: frozenset[str], triple: str, data_layout: str) -> bytes:
    """``bitcode`` reduced to the functions ``names`` and what they use."""
    lib = llvm.parse_bitcode(bitcode)
    lib.triple, lib.data_layout = triple, data_layout  # libdevice says nvptx64-nvidia-gpulibs
    defined = {f.name for f in lib.functions if not f.is_declaration}
    missing = sorted(names - defined)
    if missing:
        raise CodegenError(f"libdevice has no function(s) {', '.join(missing)}")
    for f in lib.functions:
        if not f.is_declaration and f.name not in names:
            f.linkage = llvm.Linkage.internal
    mpm = llvm.create_new_module_pass_manager()
    mpm.add_global_dead_code_eliminate_pass()
    tm = llvm.Target.from_triple(triple).create_target_machine(opt=0)
    mpm.run(lib, llvm.create_pass_builder(tm, llvm.create_pipeline_tuning_options(speed_level=0)))
    return lib.as_bitcode()


def _pruned_bitcode(names: frozenset[str], triple: str, data_layout: str) -> bytes:
    """libdevice reduced to ``names`` (cached). Two levels, because parsing all of libdevice is
    what costs: the base (rebuilt from libdevice.10.bc only if a request names a function
    beyond it), and per-set prunes of that small base."""
    key = (triple, data_layout, names)
    hit = _pruned.get(key)
    if hit is not None:
        _pruned.move_to_end(key)
        return hit
    base_names, base = _base.get((triple, data_layout), (EXPECTED, b""))
    if not base or not names <= base_names:
        base_names |= names
        base = _prune(find_libdevice().read_bytes(), base_names, triple, data_layout)
        _base[triple, data_layout] = (base_names, base)
    bc = base if names == base_names else _prune(base, names, triple, data_layout)
    _pruned[key] = bc
    if len(_pruned) > _CACHE_SIZE:
        _pruned.popitem(last=False)
    return bc


def link_libdevice(module: llvm.ModuleRef) -> list[str]:
    """Link the libdevice functions ``module`` declares into it; return their names. The caller
    holds LLVM's lock and internalises them afterwards (so O3 inlines and drops them)."""
    names = frozenset(f.name for f in module.functions if f.is_declaration and f.name.startswith(PREFIX))
    if names:
        module.link_in(llvm.parse_bitcode(_pruned_bitcode(names, module.triple, module.data_layout)))
    return sorted(names)
