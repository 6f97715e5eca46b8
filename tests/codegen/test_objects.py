"""The CPU's machine-code objects: on-disk cache and forked parallel compilation (codegen/objects.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from sextant.codegen import CodegenError, compile_kernels, emit_module
from sextant.codegen.llvm_cpu import host_target_machine
from sextant.codegen.objects import compile_objects, prune
from sextant.graph.dtypes import DType
from sextant.kernel.ir import Binary, Buffer, Const, Kernel, Load, Special, Store

F32 = DType.f32
TID = Special("tid", "x")


def scale_kernel(i: int) -> Kernel:
    body = (Store("y", TID, Binary("mul", Load("x", TID, F32), Const(float(i + 1), F32), F32)),)
    return Kernel(f"scale{i}", (Buffer("x", F32, 64), Buffer("y", F32, 64, role="out")), (1, 1, 1), (64, 1, 1), body)


def texts(n: int) -> list[str]:
    tm = host_target_machine()
    return [str(emit_module([scale_kernel(i)], tm)) for i in range(n)]


def test_objects_are_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SEXTANT_CACHE_DIR", str(tmp_path))
    tm, ts = host_target_machine(), texts(3)
    first, hits = compile_objects(ts, tm, workers=1)
    assert hits == 0 and len(list(tmp_path.rglob("*.o"))) == 3
    again, hits = compile_objects(ts, tm, workers=1)
    assert hits == 3 and again == first


def test_cache_off(tmp_path, monkeypatch):
    monkeypatch.setenv("SEXTANT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SEXTANT_CACHE", "0")
    _, hits = compile_objects(texts(2), host_target_machine(), workers=1)
    assert hits == 0 and not list(tmp_path.rglob("*.o"))


def test_forked_workers_give_the_same_objects(monkeypatch):
    monkeypatch.setenv("SEXTANT_CACHE", "0")
    tm, ts = host_target_machine(), texts(6)
    assert compile_objects(ts, tm, workers=3)[0] == compile_objects(ts, tm, workers=1)[0]


@pytest.mark.parametrize("workers", [1, 2])
def test_invalid_ir_is_a_codegen_error(monkeypatch, workers):
    monkeypatch.setenv("SEXTANT_CACHE", "0")
    ts = texts(4)
    ts[-1] = ts[-1].replace("ret void", "ret i32 0")
    with pytest.raises(CodegenError, match="generated LLVM IR is invalid"):
        compile_objects(ts, host_target_machine(), workers=workers)


def test_cached_kernels_run(tmp_path, monkeypatch):
    monkeypatch.setenv("SEXTANT_CACHE_DIR", str(tmp_path))
    kernels = [scale_kernel(i) for i in range(5)]
    x = torch.randn(64)
    for expect_cached in (0, 5):  # compiled in workers, then all from the cache
        m = compile_kernels(kernels)
        assert m.cached_objects == expect_cached
        for i in range(5):
            y = torch.zeros(64)
            m.launch(f"scale{i}", [x, y])
            torch.testing.assert_close(y, x * (i + 1))
    assert "define void @scale4" in m.optimized_ir  # made on demand from the generated IR


def test_unwritable_cache_only_costs_time(tmp_path, monkeypatch):
    blocker = Path(tmp_path) / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("SEXTANT_CACHE_DIR", str(blocker))
    objs, hits = compile_objects(texts(1), host_target_machine(), workers=1)
    assert hits == 0 and len(objs) == 1


def test_prune_drops_least_recently_used(tmp_path, monkeypatch):
    monkeypatch.setenv("SEXTANT_CACHE_DIR", str(tmp_path))
    ts = texts(4)
    compile_objects(ts, host_target_machine(), workers=1)
    files = sorted(tmp_path.rglob("*.o"))
    for age, p in enumerate(files):  # files[0] is the oldest
        os.utime(p, (1000 + age, 1000 + age))
    size = sum(p.stat().st_size for p in files)
    prune(tmp_path, max_bytes=size - 1)
    left = sorted(tmp_path.rglob("*.o"))
    assert files[0] not in left and files[-1] in left and sum(p.stat().st_size for p in left) <= 0.8 * size


def test_kernel_keys_see_every_detail_of_the_kernel_ir():
    from dataclasses import replace

    from sextant.codegen.llvm_cpu import kernel_key
    from sextant.codegen.objects import DEFAULT_OPTIONS, PassOptions

    tm, k = host_target_machine(), scale_kernel(0)
    key = kernel_key(k, tm, DEFAULT_OPTIONS, 64)
    assert key == kernel_key(scale_kernel(0), tm, DEFAULT_OPTIONS, 64)
    other_dtype = replace(k, params=(Buffer("x", DType.f16, 64), k.params[1]))
    other_const = scale_kernel(1)
    assert len({key, kernel_key(other_dtype, tm, DEFAULT_OPTIONS, 64), kernel_key(replace(other_const, name=k.name), tm,
                DEFAULT_OPTIONS, 64), kernel_key(k, tm, DEFAULT_OPTIONS, 32),
                kernel_key(k, tm, PassOptions(speed_level=2), 64)}) == 5
