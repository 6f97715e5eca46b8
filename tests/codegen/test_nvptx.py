"""The NVPTX code generator, without a GPU: hand-written kernels are lowered to PTX for sm_80
and sm_90 and assembled by ptxas, which validates the PTX and reports registers, shared memory
and spills; the PTX is checked for the instructions each construct must become. Every math op
is compiled in a subprocess, since an LLVM fatal error (a math intrinsic NVPTX cannot select)
kills the whole process. ptxas is required: if it cannot be found the tests fail, naming why."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest
from test_cpu_kernels import (
    block_sum_kernel,
    gid,
    register_tile_kernel,
    tiled_matmul_kernel,
    warp_reduce_kernel,
)
from test_cpu_ops import CASES, _expr, elementwise_kernel

from sextant.codegen import CodegenError
from sextant.codegen.llvm_nvptx import PtxModule, emit_ptx, ptx_features
from sextant.codegen.ptxas import PtxasError, PtxasResult, assemble, find_ptxas, parse_resources
from sextant.graph.dtypes import DType
from sextant.kernel.ir import (
    Assign,
    AtomicAdd,
    Barrier,
    Binary,
    Buffer,
    Cast,
    Const,
    Expr,
    For,
    If,
    Kernel,
    Load,
    Select,
    Special,
    Store,
    Unary,
    Var,
    WarpReduce,
    add,
    c,
    lt,
    mul,
)

ARCHS = ("sm_80", "sm_90")
F32, I32, I64, BOOL = DType.f32, DType.i32, DType.i64, DType.bool
TID, BID = Special("tid", "x"), Special("bid", "x")
# the only LLVM intrinsics the lowering may declare: NVPTX selects each of them exactly
SAFE_INTRINSICS = re.compile(
    r"llvm\.(nvvm\..*|(sqrt|fabs|floor|ceil|trunc|roundeven|copysign|maximum|minimum)\.f(32|64))")


@cache
def compiled(kernels: tuple[Kernel, ...], arch: str) -> tuple[PtxModule, PtxasResult]:
    m = emit_ptx(kernels, arch)
    return m, assemble(m.ptx, arch)


def entry(ptx: str, name: str) -> str:
    """The PTX text of one ``.entry``."""
    m = re.search(rf"\.entry {name}\(.*?^\}}", ptx, re.MULTILINE | re.DOTALL)
    assert m, f"no .entry {name} in the PTX"
    return m.group(0)


def declared_intrinsics(llvm_ir: str) -> set[str]:
    return set(re.findall(r'^declare [^@]*@"?(llvm\.[\w.]+)', llvm_ir, re.MULTILINE))


def check(kernels: list[Kernel], arch: str, expect: dict[str, list[str]]) -> PtxasResult:
    """Emit and assemble; every kernel is an .entry with registers reported, and the entry
    ``name`` contains each PTX pattern in ``expect[name]``."""
    m, res = compiled(tuple(kernels), arch)
    assert m.names == [k.name for k in kernels]
    assert f".target {arch}" in m.ptx
    unsafe = {f for f in declared_intrinsics(m.llvm_ir) if not SAFE_INTRINSICS.fullmatch(f)}
    assert not unsafe, f"intrinsics NVPTX cannot select: {unsafe}"
    for k in kernels:
        assert f".visible .entry {k.name}(" in m.ptx
        assert res.kernels[k.name].registers > 0
        text = entry(m.ptx, k.name)
        assert f".reqntid {', '.join(map(str, k.block))}" in text
        for pat in expect.get(k.name, []):
            assert re.search(pat, text), f"{k.name} ({arch}): no {pat!r} in\n{text}"
    return res


def test_ptxas_is_available():
    exe = find_ptxas()
    assert exe.is_file(), exe
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True).stdout
    assert "ptxas" in out.lower()


# -- kernels ---------------------------------------------------------------------------------------
def elementwise_guard_kernel(n: int = 1000, T: int = 128) -> Kernel:
    i = Var("i")
    body = (Assign(i, gid(T)),
            If(lt(i, c(n)), (Store("y", i, Binary("add", Binary("mul", Load("x", i, F32), Const(2.0, F32), F32),
                                                    Load("y", i, F32), F32)),)))
    return Kernel("axpy", (Buffer("x", F32, n), Buffer("y", F32, n, role="inout")), (-(-n // T), 1, 1), (T, 1, 1),
                  body)


def dynamic_local_kernel(T: int = 64, nb: int = 4, R: int = 16) -> Kernel:
    """A per-thread histogram indexed by data: the local array cannot live in registers."""
    j, h = Var("j"), Var("h")
    body = (
        For(j, c(0), c(R), 1, (Store("hist", j, c(0)),)),
        For(j, c(0), c(R), 1, (
            Assign(h, Binary("bitwise_and", Load("x", add(mul(gid(T), c(R)), j), I32), c(R - 1), I32)),
            Store("hist", h, add(Load("hist", h, I32), c(1))),
        )),
        For(j, c(0), c(R), 1, (Store("y", add(mul(gid(T), c(R)), j), Load("hist", j, I32)),)),
    )
    n = T * nb * R
    return Kernel("histogram", (Buffer("x", I32, n), Buffer("y", I32, n, role="out")), (nb, 1, 1), (T, 1, 1), body,
                  local=(Buffer("hist", I32, R, "local"),))


def half_kernel(dt: DType, n: int = 4096, T: int = 256) -> Kernel:
    i = Var("i")
    body = (
        Assign(i, gid(T)),
        Store("copy", i, Load("h", i, dt)),
        Store("wide", i, Cast(Load("h", i, dt), F32)),
        Store("narrow", i, Cast(Load("f", i, F32), dt)),
        Store("sum", i, Binary("add", Load("h", i, dt), Unary("exp", Load("h", i, dt), dt), dt)),
    )
    return Kernel(f"half_{dt.value}", (Buffer("h", dt, n), Buffer("f", F32, n), Buffer("copy", dt, n, role="out"),
                                       Buffer("wide", F32, n, role="out"), Buffer("narrow", dt, n, role="out"),
                                       Buffer("sum", dt, n, role="out")), (n // T, 1, 1), (T, 1, 1), body)


def typed_warp_kernel(dt: DType, op: str, width: int, T: int) -> Kernel:
    i, r = Var("i"), Var("r", dt)
    body = (Assign(i, gid(T)), WarpReduce(r, op, Load("x", i, dt), width), Store("out", i, r))
    return Kernel(f"warp_{op}_{dt.value}_{width}_{T}", (Buffer("x", dt, 2 * T), Buffer("out", dt, 2 * T, role="out")),
                  (2, 1, 1), (T, 1, 1), body)


def two_level_reduction_kernel(T: int = 128) -> Kernel:
    """A warp reduction, partial sums through shared memory, a warp reduction of the first warp."""
    v, r, r2 = Var("v", F32), Var("r", F32), Var("r2", F32)
    warp = Binary("div", TID, c(32), I32)
    body = (
        Assign(v, Load("x", gid(T), F32)),
        WarpReduce(r, "sum", v, 32),
        If(Binary("eq", Binary("bitwise_and", TID, c(31), I32), c(0), BOOL), (Store("s", warp, r),)),
        Barrier(),
        If(lt(TID, c(32)), (
            WarpReduce(r2, "sum", Select(lt(TID, c(T // 32)), Load("s", TID, F32), Const(0.0, F32), F32), 32),
            If(Binary("eq", TID, c(0), BOOL), (Store("out", BID, r2),)),
        )),
    )
    return Kernel("block_red", (Buffer("x", F32, T * 3), Buffer("out", F32, 3, role="out")), (3, 1, 1), (T, 1, 1),
                  body, shared=(Buffer("s", F32, T // 32, "shared"),))


def coords_kernel() -> Kernel:
    specials = [Special(kind, ax) for kind in ("bid", "tid", "gdim", "bdim") for ax in "xyz"]
    g = Var("g")
    lin = add(mul(add(mul(Special("tid", "z"), c(2)), Special("tid", "y")), c(4)), TID)
    body = (Assign(g, add(mul(BID, c(24)), lin)),
            *(Store("out", add(mul(g, c(12)), c(j)), s) for j, s in enumerate(specials)))
    return Kernel("coords", (Buffer("out", I32, 5 * 24 * 12, role="out"),), (5, 3, 2), (4, 2, 3), body)


GLOBAL_LD, GLOBAL_ST = r"ld\.global(\.nc)?\.b32", r"st\.global\.b32"
SHARED = [r"st\.shared\.b32", r"ld\.shared\.b32", r"bar\.sync\s+0"]


# -- structure: memory spaces, barriers, warp shuffles --------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_core_kernels_assemble(arch):
    kernels = [elementwise_guard_kernel(), block_sum_kernel(1000), tiled_matmul_kernel(37, 45, 29),
               register_tile_kernel(32, 5), two_level_reduction_kernel(), coords_kernel()]
    res = check(kernels, arch, {
        "axpy": [GLOBAL_LD, GLOBAL_ST, r"setp\.\w+\.[su]32", r"@%p\d+ bra", r"fma\.rn\.f32", r"%tid\.x", r"%ctaid\.x"],
        "block_sum": [*SHARED, GLOBAL_LD],
        "matmul": [*SHARED, r"fma\.rn\.f32", r"%tid\.y", r"%ctaid\.y"],
        "tile": SHARED,
        "block_red": [*SHARED, r"shfl\.sync\.bfly\.b32"],
        "coords": [r"%nctaid\.[xyz]", r"%tid\.z", r"%ctaid\.z"],
    })
    m, _ = compiled(tuple(kernels), arch)
    assert re.search(r"add nsw i32", m.llvm_ir) and re.search(r"fmul contract float", m.llvm_ir)  # as on the CPU
    assert res.kernels["block_sum"].shared_bytes == 128 * 4
    assert res.kernels["matmul"].shared_bytes == 2 * 16 * 16 * 4
    assert res.kernels["block_sum"].barriers == 1
    for name in ("axpy", "matmul", "block_sum"):
        assert res.kernels[name].spill_stores == 0 and res.kernels[name].stack_frame == 0


@pytest.mark.parametrize(("arch", "isa"), [("sm_75", "8.0"), ("sm_89", "8.0"), ("sm_90a", "8.0"), ("sm_100", "8.6"),
                                           ("sm_120", "8.7")])
def test_other_architectures(arch, isa):
    kernels = [block_sum_kernel(1000), warp_reduce_kernel("max", 8, 64, 2),
               elementwise_kernel("maximum", "maximum", (F32, F32), F32), elementwise_kernel("exp", "exp", (F32,), F32)]
    m, _ = compiled(tuple(kernels), arch)
    assert f".version {isa}\n" in m.ptx
    check(kernels, arch, {"block_sum": SHARED, "maximum": [r"max(\.NaN)?\.f32|setp"]})


@pytest.mark.parametrize("arch", ARCHS)
def test_warp_reductions(arch):
    cases = [("sum", 32, 64), ("max", 32, 64), ("sum", 8, 64), ("max", 8, 64), ("min", 8, 40),  # full groups
             ("sum", 32, 48), ("max", 8, 20)]  # a partial last group
    kernels = [warp_reduce_kernel(op, w, T, 3) for op, w, T in cases]
    bfly = lambda w: [rf"shfl\.sync\.bfly\.b32\s+%r\d+, %r\d+, {o}, {((32 - w) << 8) | 31}," for o in (w // 2, 1)]
    m, _ = compiled(tuple(kernels), arch)
    check(kernels, arch, {
        "warp_sum_32_64": [*bfly(32), r"shfl\.sync\.bfly\.b32 .*, -1;", r"add\.f32"],
        "warp_max_32_64": [*bfly(32), r"max\.NaN\.f32"],
        "warp_sum_8_64": bfly(8),
        "warp_max_8_64": [*bfly(8), r"max\.NaN\.f32"],
        "warp_min_8_40": [*bfly(8), r"min\.NaN\.f32"],
        "warp_sum_32_48": [r"shfl\.sync\.down\.b32", r"shfl\.sync\.idx\.b32"],
        "warp_max_8_20": [r"shfl\.sync\.down\.b32", r"shfl\.sync\.idx\.b32"],
    })
    for op, w, T in cases:
        n_shfl = len(re.findall(r"shfl\.sync", entry(m.ptx, f"warp_{op}_{w}_{T}")))
        assert n_shfl == (w.bit_length() - 1) + (T % w != 0)  # log2(w) steps (+ a broadcast)
    assert re.search(r"selp\.b32\s+%r\d+, -1, 255,", entry(m.ptx, "warp_min_8_40"))  # 40 threads: 8 in warp 1


@pytest.mark.parametrize("arch", ARCHS)
def test_warp_reductions_of_every_dtype(arch):
    kernels = [typed_warp_kernel(DType.i32, "sum", 32, 64), typed_warp_kernel(DType.i64, "max", 16, 64),
               typed_warp_kernel(DType.f16, "sum", 32, 64), typed_warp_kernel(DType.bf16, "max", 8, 64),
               typed_warp_kernel(DType.bool, "max", 32, 64), typed_warp_kernel(DType.i64, "prod", 32, 40)]
    m, _ = compiled(tuple(kernels), arch)
    check(kernels, arch, {k.name: [r"shfl\.sync"] for k in kernels})
    assert len(re.findall(r"shfl\.sync\.bfly", entry(m.ptx, "warp_max_i64_16_64"))) == 2 * 4  # two words a step


@pytest.mark.parametrize("arch", ARCHS)
def test_local_arrays(arch):
    res = check([dynamic_local_kernel(), register_tile_kernel(32, 5)], arch, {
        "histogram": [r"st\.local\.b32", r"ld\.local\.b32"],
    })
    assert res.kernels["histogram"].stack_frame >= 16 * 4  # in .local memory: indexed by data
    assert res.kernels["tile"].stack_frame == 0  # constant indices: SROA keeps the tile in registers


@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_loads_and_stores(arch):
    check([half_kernel(DType.f16), half_kernel(DType.bf16)], arch, {
        "half_f16": [r"ld\.global(\.nc)?\.b16", r"st\.global\.b16", r"cvt\.f32\.f16", r"cvt\.rn\.f16\.f32",
                     r"ex2\.approx"],
        "half_bf16": [r"ld\.global(\.nc)?\.b16", r"st\.global\.b16", r"shl\.b32\s+%r\d+, %r\d+, 16",
                      r"ex2\.approx"],
    })


# -- every op, grouped by family -------------------------------------------------------------------
def family_kernel(name: str, cases: list[tuple[str, tuple[DType, ...], DType]], n: int = 333, T: int = 64) -> Kernel:
    """One kernel computing every op of a family: ``o{j}[i] = op_j(a0[i], a1[i])``."""
    ins = cases[0][1]
    i = Var("i")
    loads: list[Expr] = [Load(f"a{j}", i, dt) for j, dt in enumerate(ins)]
    stores = tuple(Store(f"o{j}", i, _expr(op, loads[:len(cin)], out)) for j, (op, cin, out) in enumerate(cases))
    params = (*(Buffer(f"a{j}", dt, n) for j, dt in enumerate(ins)),
              *(Buffer(f"o{j}", out, n, role="out") for j, (_, _, out) in enumerate(cases)))
    return Kernel(name, params, (-(-n // T), 1, 1), (T, 1, 1), (Assign(i, gid(T)), If(lt(i, c(n)), stores)))


def families() -> dict[str, list[tuple[str, tuple[DType, ...], DType]]]:
    out: dict[str, list] = {}
    for op, ins, res in CASES:
        if op in ("cast", "where") or ins[0] not in (F32, I32, I64):
            continue
        out.setdefault(f"{'unary' if len(ins) == 1 else 'binary'}_{ins[0].value}", []).append((op, ins, res))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_op_families(arch):
    fams = families()
    assert set(fams) == {f"{a}_{t}" for a in ("unary", "binary") for t in ("f32", "i32", "i64")}
    assert len(fams["unary_f32"]) >= 38 and len(fams["binary_f32"]) >= 16
    kernels = [family_kernel(name, cases) for name, cases in sorted(fams.items())]
    m, res = compiled(tuple(kernels), arch)
    check(kernels, arch, {
        "unary_f32": [r"sqrt\.rn\.f32", r"ex2\.approx", r"cvt\.rni\.f32\.f32", r"cvt\.rmi\.f32\.f32", r"abs\.f32",
                      r"div\.rn\.f32"],
        "binary_f32": [r"max\.NaN\.f32", r"min\.NaN\.f32", r"div\.rn\.f32", r"setp\.nan\.f32|setp\.neu\.f32"],
        "binary_i32": [r"div\.s32", r"rem\.s32", r"shl\.b32", r"shr\.s32"],
        "binary_i64": [r"div\.s64", r"rem\.s64", r"mul\.lo\.s64"],
    })
    # libdevice is linked, inlined and otherwise dropped: no stray __nv_ functions or libm calls
    assert {"__nv_expf", "__nv_tanhf", "__nv_fmodf", "__nv_powf", "__nv_atan2f", "__nv_lgammaf"} <= set(m.libdevice)
    assert "__nv_" not in m.ptx and ".extern" not in m.ptx
    assert all(r.spill_stores == 0 for r in res.kernels.values())


def test_fmod_is_exact_not_llvm_frem():
    """NVPTX lowers ``frem`` to the inexact x - trunc(x/y)*y: fmod must come from libdevice."""
    kernels = [elementwise_kernel("fmod_f32", "fmod", (F32, F32), F32)]
    m, _ = compiled(tuple(kernels), "sm_90")
    assert "frem" not in m.llvm_ir and "__nv_fmodf" in m.libdevice


def test_math_ops_never_abort_llvm(tmp_path):
    """Every op in every dtype (and casts), for both architectures, each in a child process: an
    LLVM fatal error there fails this test instead of killing pytest. The PTX is assembled."""
    here = Path(__file__).parent
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(here)!r}]
        from test_cpu_ops import CASES, _name, elementwise_kernel
        from sextant.codegen.llvm_nvptx import emit_ptx
        arch = sys.argv[1]
        m = emit_ptx([elementwise_kernel(_name(*case), *case) for case in CASES], arch)
        open({str(tmp_path)!r} + f"/ops_{{arch}}.ptx", "w").write(m.ptx)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parents[1]), os.environ.get("PYTHONPATH", "")]))
    children = {arch: subprocess.Popen([sys.executable, "-c", script, arch], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=env) for arch in ARCHS}
    for arch, child in children.items():
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, f"{arch}: the child died (exit {child.returncode}):\n{out}\n{err[-4000:]}"
    with ThreadPoolExecutor(len(ARCHS)) as pool:
        results = pool.map(lambda a: assemble((tmp_path / f"ops_{a}.ptx").read_text(), a), ARCHS)
        for res in results:
            assert len(res.kernels) == len(CASES)
            assert all(r.registers > 0 for r in res.kernels.values())


# -- errors and the ptxas wrapper ------------------------------------------------------------------
def test_ptxas_errors_carry_its_message():
    m, _ = compiled((block_sum_kernel(1000),), "sm_90")
    with pytest.raises(PtxasError, match=r"(?s)Unknown modifier.*bar\.sink"):
        assemble(m.ptx.replace("bar.sync", "bar.sink", 1), "sm_90")


def test_find_ptxas_names_how_to_install(monkeypatch, tmp_path):
    import sextant.codegen.cuda_tools as cuda_tools

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cuda_tools, "TOOLKIT_DIRS", (str(tmp_path),))
    monkeypatch.setattr(cuda_tools.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PtxasError, match="pip install nvidia-cuda-nvcc"):
        find_ptxas()


def test_find_ptxas_in_the_nvidia_cuda_nvcc_wheel(monkeypatch, tmp_path):
    """Without a toolkit, ptxas comes from PyPI's nvidia-cuda-nvcc (``make test`` installs it then)."""
    import types

    import sextant.codegen.cuda_tools as cuda_tools

    exe = tmp_path / "site" / "nvidia" / "cu13" / "bin" / "ptxas"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(cuda_tools, "TOOLKIT_DIRS", ())
    spec = types.SimpleNamespace(submodule_search_locations=[str(tmp_path / "site" / "nvidia")])
    monkeypatch.setattr(cuda_tools.importlib.util, "find_spec", lambda name: spec if name == "nvidia" else None)
    assert find_ptxas() == exe


def test_parse_resources():
    log = textwrap.dedent("""\
        ptxas info    : 0 bytes gmem
        ptxas info    : Function properties for __internal_trig_reduction_slowpathd
            40 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Compiling entry function 'a' for 'sm_90'
        ptxas info    : Function properties for a
            64 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
        ptxas info    : Used 255 registers, used 1 barriers, 4096 bytes smem, 368 bytes cmem[0]
        ptxas info    : Compiling entry function 'b' for 'sm_90'
        ptxas info    : Function properties for b
            0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 9 registers
        """)
    r = parse_resources(log)
    assert set(r) == {"a", "b"}
    a = r["a"]
    assert (a.registers, a.barriers, a.shared_bytes, a.constant_bytes) == (255, 1, 4096, 368)
    assert (a.stack_frame, a.spill_stores, a.spill_loads) == (64, 8, 4)
    assert (r["b"].registers, r["b"].shared_bytes, r["b"].stack_frame) == (9, 0, 0)


def test_codegen_errors():
    with pytest.raises(CodegenError, match="232448 bytes a block may use on sm_90"):
        emit_ptx([Kernel("big", (Buffer("o", F32, 1, role="out"),), (1, 1, 1), (32, 1, 1), (),
                         shared=(Buffer("s", F32, 60000, "shared"),))])
    with pytest.raises(CodegenError, match="101376 bytes a block may use on sm_86"):
        emit_ptx([Kernel("big", (Buffer("o", F32, 1, role="out"),), (1, 1, 1), (32, 1, 1), (),
                         shared=(Buffer("s", F32, 26000, "shared"),))], arch="sm_86")
    with pytest.raises(CodegenError, match="not a valid PTX identifier"):
        emit_ptx([Kernel("a.b", (), (1, 1, 1), (1, 1, 1), ())])
    with pytest.raises(CodegenError, match="architecture"):
        ptx_features("gfx90a")
    assert ptx_features("sm_90") == "+ptx80" and ptx_features("sm_120") == "+ptx87"
    bad = Kernel("bad", (Buffer("a", I32, 4), Buffer("o", I32, 4)), (1, 1, 1), (1, 1, 1),
                 (Store("o", c(0), Unary("sqrt", Load("a", c(0), I32), I32)),))
    with pytest.raises(CodegenError, match="sqrt needs a float operand"):
        emit_ptx([bad])
    w = Var("w", F32)
    bad_w = Kernel("badw", (Buffer("a", F32, 4),), (1, 1, 1), (32, 1, 1),
                   (WarpReduce(w, "sum", Load("a", c(0), F32), 12),))
    with pytest.raises(CodegenError, match="power of two"):
        emit_ptx([bad_w])


def test_libdevice_link_beyond_the_expected_set():
    """A module may call any libdevice function: one outside what NvptxMath uses rebuilds the base."""
    import llvmlite.binding as llvm

    from sextant.codegen.libdevice import EXPECTED, link_libdevice
    from sextant.codegen.llvm_nvptx import TRIPLE, nvptx_target_machine

    assert "__nv_cbrtf" not in EXPECTED
    tm = nvptx_target_machine("sm_90")
    src = f"""
        target triple = "{TRIPLE}"
        target datalayout = "{tm.target_data}"
        declare float @__nv_cbrtf(float)
        declare float @__nv_expf(float)
        define ptx_kernel void @k(ptr addrspace(1) %p) {{
          %x = load float, ptr addrspace(1) %p
          %y = call float @__nv_cbrtf(float %x)
          %z = call float @__nv_expf(float %y)
          store float %z, ptr addrspace(1) %p
          ret void
        }}"""
    mod = llvm.parse_assembly(src)
    assert link_libdevice(mod) == ["__nv_cbrtf", "__nv_expf"]
    defined = {f.name for f in mod.functions if not f.is_declaration}
    assert {"__nv_cbrtf", "__nv_expf"} <= defined and "__nv_sinf" not in defined


def test_scheduled_mlp_for_sm90():
    """Kernels as the scheduler writes them for a GPU target: an MLP's fused kernels."""
    from sextant import examples
    from sextant.frontend.capture import capture
    from sextant.graph.passes import run_pipeline
    from sextant.schedule.program import schedule
    from sextant.schedule.target import sm90_target

    module, args = examples.mlp()
    program = schedule(run_pipeline(capture(module, args, None), "default"), sm90_target())
    kernels = list(program.kernels.values())
    res = check(kernels, "sm_90", {})
    assert set(res.kernels) == set(program.kernels)
    assert all(r.spill_stores == 0 for r in res.kernels.values())


def test_shared_memory_past_48_kib_is_one_dynamic_array():
    from sextant.kernel.shared_memory import dynamic_shared_bytes

    small = Kernel("small", (Buffer("o", F32, 1, role="out"),), (1, 1, 1), (32, 1, 1), (),
                   shared=(Buffer("s", F32, 1000, "shared"),))
    big = Kernel("big", (Buffer("o", F32, 1, role="out"),), (1, 1, 1), (32, 1, 1), (),
                 shared=(Buffer("s", F32, 13000, "shared"), Buffer("t", DType.f16, 3, "shared")))
    assert dynamic_shared_bytes(small) == 0
    assert dynamic_shared_bytes(big) == 52000 + 16  # each buffer 16-byte aligned
    from sextant.codegen.llvm_nvptx import emit_llvm

    text = str(emit_llvm([small, big]))
    assert re.search(r'@"?big_dynamic_shared"? = external addrspace\(3\) global \[0 x i8\], align 16', text), text
    assert "small_dynamic_shared" not in text and "small.s" in text  # under 48 KiB: a static array


def atomic_histogram_kernel(dt: DType, n: int = 1000, bins: int = 7, T: int = 128) -> Kernel:
    """Every thread adds its element into one of a few bins: many threads hit one address."""
    i = Var("i")
    body = (Assign(i, gid(T)),
            If(lt(i, c(n)), (AtomicAdd("bins", Binary("remainder", i, c(bins), I32), Load("x", i, dt)),)))
    return Kernel(f"hist_{dt.value}", (Buffer("x", dt, n), Buffer("bins", dt, bins, role="inout")),
                  (-(-n // T), 1, 1), (T, 1, 1), body)


@pytest.mark.parametrize("arch", ARCHS)
def test_atomic_add_is_a_global_atomic(arch):
    """f32/f16/i32/i64 become ``atom.global.add`` (``red`` when the old value is unused); bf16, which
    llvmlite holds as i16 bits, a compare-and-swap loop."""
    kernels = [atomic_histogram_kernel(dt) for dt in (F32, DType.f16, I32, I64, DType.bf16)]
    check(kernels, arch, {
        "hist_f32": [r"(atom|red)\.global\.add\.f32"],
        "hist_f16": [r"(atom|red)\.global\.add\.noftz\.f16"],
        "hist_i32": [r"(atom|red)\.global\.add\.u32"],
        "hist_i64": [r"(atom|red)\.global\.add\.u64"],
        "hist_bf16": [r"atom\.[\w.]*global\.cas\.b32"],
    })
