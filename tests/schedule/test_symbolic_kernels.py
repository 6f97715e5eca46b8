"""Kernels over symbolic sizes (``kernel/sizes.py``, the CPU and GPU mappings): the sizes are scalar
kernel arguments, so one compiled program serves every size in range. Each test compiles once and
runs at the range's ends and at ragged sizes in between, against eager."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import sextant
from sextant.errors import InputError
from sextant.graph.dtypes import DType
from sextant.graph.symbolic import SymDim
from sextant.kernel.ir import INDEX, Binary, Buffer, Const, Kernel, Load, Size, Special, Store
from sextant.kernel.printer import print_kernel
from sextant.kernel.ranges import eval_expr
from sextant.kernel.sizes import dim_expr, instantiate, size_var, verification_points, with_grid
from sextant.kernel.verifier import KernelVerificationError, verify_kernel

SEQ = SymDim.symbol("seq", 1, 300)
BATCH = SymDim.symbol("batch", 1, 8)


@pytest.mark.parametrize("dim", [SEQ * BATCH + 3, (SEQ + 127) // 128, -(-SEQ // 16), (SEQ - 1) % 7, SEQ * SEQ,
                                 (BATCH * SEQ - BATCH) // 3, -(-(2 * SEQ - 5) // 4)])
def test_size_expressions_evaluate_like_the_sizes(dim: SymDim) -> None:
    """Floor and ceiling division and remainders keep Python's (floor) semantics in the kernel IR,
    whose ``div`` truncates: ``-floor(-seq/16)`` (a ceiling) was once off by one for small sizes."""
    e = dim_expr(dim)
    for seq in (1, 2, 15, 16, 17, 300):
        for batch in (1, 3):
            values = {"n_seq": seq, "n_batch": batch}
            assert eval_expr(e, values) == dim.subs({"seq": seq, "batch": batch}), (dim, seq, batch)


def _copy_kernel(extra: int) -> Kernel:
    """``out[i] = in[i + extra]`` for ``i < seq``: in bounds only when ``extra`` is 0."""
    i = Special("bid", "x")
    n = size_var("seq")
    body = (Store("out0", i, Load("in0", Binary("add", i, Const(extra, INDEX), INDEX), DType.f32)),)
    k = with_grid(Kernel("copy", (Buffer("in0", DType.f32, SEQ), Buffer("out0", DType.f32, SEQ, role="out")),
                         (1, 1, 1), (1, 1, 1), body, sizes=(Size("seq", 1, 300),)), (SEQ, 1, 1))
    assert n.name == "n_seq"
    return k


def test_symbolic_kernels_are_verified_at_their_instances() -> None:
    ok = _copy_kernel(0)
    verify_kernel(ok)
    static = instantiate(ok, {"seq": 7})
    assert static.sizes == () and static.grid == (7, 1, 1) and static.params[0].size == 7
    with pytest.raises(KernelVerificationError, match=r"at sizes seq=1"):
        verify_kernel(_copy_kernel(1))
    assert verification_points(ok.sizes) == [{"seq": 1}, {"seq": 71}]
    assert "size n_seq in [1, 300]" in print_kernel(ok) and "grid=seq (at most 300)" in print_kernel(ok)


class _Mixer(nn.Module):
    """Elementwise with broadcasts and reshapes, a LayerNorm and a softmax over a static axis, a
    sum over the symbolic sequence, and Linear layers (GEMMs with a symbolic M)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(24, 40), nn.Linear(40, 24)
        self.norm = nn.LayerNorm(40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.softmax(self.norm(torch.relu(self.a(x))), -1)
        pooled = h.mean(1, keepdim=True)  # over the symbolic sequence
        return self.b(h - pooled) + x.sum(-1, keepdim=True)


class _Attention(nn.Module):
    """Self-attention of four heads of ``head`` (8 by default: f32 stays unfused on the GPU; 16 in f16
    is what the tensor-core flash kernel computes)."""

    def __init__(self, causal: bool, head: int = 8) -> None:
        super().__init__()
        self.causal, self.head = causal, head
        self.qkv = nn.Linear(4 * head, 12 * head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, 4, self.head).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return o.transpose(1, 2).reshape(b, s, 4 * self.head)


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, stride=2, groups=8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.c1(x))).mean((2, 3))


def _one_program(cm: sextant.CompiledModule) -> None:
    assert cm.stages.get("per_binding") is None, cm.stages.get("per_binding")
    program = cm.stages["program"]
    assert program.symbols and any(k.sizes for k in program.kernels.values())


@pytest.mark.parametrize("name, model, example, dims, shapes", [
    ("mixer", _Mixer(), (2, 5, 24), {0: Dim("batch", min=1, max=6), 1: Dim("seq", min=1, max=200)},
     [(1, 1, 24), (3, 7, 24), (6, 200, 24), (2, 129, 24)]),
    ("attention", _Attention(False), (2, 9, 32), {0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=300)},
     [(1, 1, 32), (3, 17, 32), (2, 300, 32), (1, 257, 32)]),
    ("causal", _Attention(True), (2, 9, 32), {0: Dim("batch", min=1, max=4), 1: Dim("seq", min=1, max=300)},
     [(1, 1, 32), (3, 17, 32), (2, 300, 32), (1, 257, 32)]),
    ("conv", _Conv(), (2, 3, 12, 12), {0: Dim("batch", min=1, max=9)},
     [(1, 3, 12, 12), (9, 3, 12, 12), (5, 3, 12, 12)]),
])
@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_one_program_runs_every_size(name: str, model: nn.Module, example: tuple, dims: dict,
                                     shapes: list[tuple], target: str) -> None:
    """On cuda-sim the GPU mappings (thread per element, warp/block per row, the tiled CUDA-core GEMM,
    here also for attention's unfused fp32 products with a symbolic N or K, the implicit-GEMM and
    direct convolutions over a symbolic batch) are the kernels; their PTX with the size parameters is
    assembled by ptxas too."""
    torch.manual_seed(0)
    model = model.eval()
    cm = sextant.compile(model, (torch.randn(example),), target=target, dynamic_shapes={"x": dims})
    _one_program(cm)
    with torch.no_grad():
        for shape in shapes:
            x = torch.randn(shape)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
    assert len(cm.stages["program"]._layouts) == len(shapes)  # a memory plan per binding, no compile


def test_merged_rows_index_without_divisions() -> None:
    """``[batch, seq, 24]`` read as ``[batch*seq, 24]`` by a GEMM: the row index is the merged row
    itself, not ``r / n_seq * n_seq + r % n_seq`` (which the simplifier cannot fold for a symbolic
    divisor: a division per element)."""
    cm = sextant.compile(_Mixer().eval(), (torch.randn(2, 5, 24),), target="cpu",
                         dynamic_shapes={"x": {0: Dim("batch", min=1, max=6), 1: Dim("seq", min=1, max=200)}})
    gemms = [print_kernel(k) for name, k in cm.stages["program"].kernels.items() if name.startswith("matmul")]
    assert gemms and not any("/ n_seq" in text or "% n_seq" in text for text in gemms)


def test_sizes_out_of_range_are_refused() -> None:
    cm = sextant.compile(_Mixer().eval(), (torch.randn(2, 5, 24),), target="cpu",
                         dynamic_shapes={"x": {0: Dim("batch", min=1, max=6), 1: Dim("seq", min=1, max=200)}})
    with pytest.raises(InputError, match=r"dimension 1 is 201, outside the range .*seq in \[1, 200\]"):
        cm(torch.randn(1, 201, 24))


class _SymbolicK(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


def test_a_mapping_that_needs_a_size_compiles_per_binding() -> None:
    """The CPU GEMM needs a static K: a product over a symbolic K is compiled per binding, the reason
    kept, and still correct."""
    k = Dim("k", min=1, max=64)
    cm = sextant.compile(_SymbolicK(), (torch.randn(8, 5), torch.randn(5, 16)), target="cpu",
                         dynamic_shapes={"a": {1: k}, "b": {0: k}})
    assert "static N and K" in cm.stages["per_binding"]
    for kk in (1, 33):
        a, b = torch.randn(8, kk), torch.randn(kk, 16)
        torch.testing.assert_close(cm(a, b), a @ b)
    assert len(cm.stages["specializer"].modules) == 2


def test_kernel_dedup_keeps_the_sizes() -> None:
    """Two identical layers share one symbolic kernel, and its launches share its size arguments."""
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU()).eval()
    cm = sextant.compile(model, (torch.randn(3, 16),), target="cpu",
                         dynamic_shapes={"input": {0: Dim("rows", max=100)}})
    program = cm.stages["program"]
    names = [la.kernel for la in program.launches]
    assert len(set(names)) < len(names)
    assert all(program.kernels[n].sizes == (Size(*program.symbols[0]),) for n in names)
    for rows in (2, 3, 100):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(cm(x), model(x))


def test_a_size_that_may_be_zero_is_verified_where_blocks_run() -> None:
    """A symbol whose range starts at 0: the GPU row mappings launch no block at 0 rows, so the
    verifier checks the smallest non-empty size instead (it once checked a one-block instance of an
    empty launch and refused the kernel)."""
    model = _RowSum().eval()
    for target in ("cpu", "cuda-sim"):
        cm = sextant.compile(model, (torch.randn(3, 16),), target=target,
                             dynamic_shapes={"x": {0: Dim("rows", min=0, max=1000)}})
        _one_program(cm)
        for rows in (0, 1, 999):
            x = torch.randn(rows, 16)
            torch.testing.assert_close(cm(x), model(x))


class _RowSum(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1) * 2


def test_sizes_past_32_bit_indexing_are_refused() -> None:
    program = sextant.compile(_RowSum().eval(), (torch.randn(3, 16),), target="cpu",
                              dynamic_shapes={"x": {0: Dim("rows")}}).stages["program"]
    with pytest.raises(InputError, match="32-bit"):
        program.layout({program.symbols[0][0]: 2**28})


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_threads_call_one_program_at_different_sizes(target: str) -> None:
    """Per-thread arenas grow to the largest binding a thread has seen; bindings, plans and layouts
    are shared caches: four threads at interleaved sizes all match eager."""
    from concurrent.futures import ThreadPoolExecutor

    torch.manual_seed(0)
    model = _Mixer().eval()
    cm = sextant.compile(model, (torch.randn(2, 5, 24),), target=target,
                         dynamic_shapes={"x": {0: Dim("batch", min=1, max=6), 1: Dim("seq", min=1, max=200)}})
    inputs = [torch.randn(1 + i % 6, 1 + (37 * i) % 200, 24) for i in range(24)]
    with torch.no_grad():
        expected = [model(x) for x in inputs]
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(cm, inputs))
    for g, want in zip(got, expected):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("half", [False, True])
def test_tensor_core_gemms_over_symbolic_sizes(half: bool) -> None:
    """tf32 (f32 with ``allow_tf32``) and f16 GEMMs on cuda-sim's tensor-core mappings: the tile is
    chosen for the largest sizes, the rows past M are guarded, the operands load element by element
    (a cp.async chunk could straddle a symbolic end) — one program at every size."""
    torch.manual_seed(0)
    model = _Mixer().eval()
    dtype = torch.float16 if half else torch.float32
    model = model.to(dtype)
    before = torch.backends.cuda.matmul.allow_tf32  # (a module attribute monkeypatch cannot restore)
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        cm = sextant.compile(model, (torch.randn(2, 5, 24, dtype=dtype),), target="cuda-sim",
                             dynamic_shapes={"x": {0: Dim("batch", min=1, max=6), 1: Dim("seq", min=1, max=200)}})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    _one_program(cm)
    mappings = {k.meta.get("mapping") for k in cm.stages["program"].kernels.values()}
    assert ("tensor-core" if half else "tensor-core-tf32") in mappings
    with torch.no_grad():
        for shape in [(1, 1, 24), (3, 7, 24), (6, 200, 24), (2, 129, 24)]:
            x = torch.randn(shape, dtype=dtype)
            torch.testing.assert_close(cm(x).float(), model(x).float(), rtol=1e-2, atol=1e-2)


class _HalfConv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(16, 32, 3, padding=1), nn.Conv2d(32, 32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).mean((2, 3))


def test_tensor_core_convolutions_over_a_symbolic_batch() -> None:
    """f16 convolutions on cuda-sim: the tensor-core implicit GEMM, whose columns (images × positions)
    follow the symbolic batch, at batch 1, 5 and 9 from one program."""
    torch.manual_seed(0)
    model = _HalfConv().eval().half()
    cm = sextant.compile(model, (torch.randn(2, 16, 12, 12).half(),), target="cuda-sim",
                         dynamic_shapes={"x": {0: Dim("batch", min=1, max=9)}})
    _one_program(cm)
    assert "tensor-core-implicit-gemm" in {k.meta.get("mapping") for k in cm.stages["program"].kernels.values()}
    with torch.no_grad():
        for batch in (1, 5, 9):
            x = torch.randn(batch, 16, 12, 12).half()
            torch.testing.assert_close(cm(x).float(), model(x).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_over_symbolic_lengths(causal: bool) -> None:
    """The tensor-core flash kernel with symbolic sequence lengths on cuda-sim: whole key tiles run in
    the double-buffered loop, the ragged tail (absent when the length is a multiple of the tile) is
    decided per launch; lengths below, at and past one and two tiles."""
    torch.manual_seed(0)
    model = _Attention(causal, head=16).eval().half()
    cm = sextant.compile(model, (torch.randn(2, 9, 64).half(),), target="cuda-sim",
                         dynamic_shapes={"x": {0: Dim("batch", min=1, max=3), 1: Dim("seq", min=1, max=300)}})
    _one_program(cm)
    assert "flash-attention-tensor-core" in {k.meta.get("mapping") for k in cm.stages["program"].kernels.values()}
    with torch.no_grad():
        for shape in [(1, 1, 64), (2, 63, 64), (1, 64, 64), (3, 65, 64), (1, 128, 64), (2, 300, 64)]:
            x = torch.randn(shape).half()
            torch.testing.assert_close(cm(x).float(), model(x).float(), rtol=1e-2, atol=1e-2)


class _Smooth(nn.Module):
    """Convolutions over a symbolic length (wav2vec2's feature extractor, in small)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv1d(4, 8, 3, padding=1), nn.Conv1d(8, 8, 5, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_convolutions_over_a_symbolic_length(target: str) -> None:
    torch.manual_seed(0)
    model = _Smooth().eval()
    cm = sextant.compile(model, (torch.randn(2, 4, 16),), target=target,
                         dynamic_shapes={"x": {0: Dim("batch", min=1, max=4), 2: Dim("length", min=7, max=300)}})
    _one_program(cm)
    with torch.no_grad():
        for shape in [(1, 4, 7), (3, 4, 64), (2, 4, 129), (4, 4, 300)]:
            x = torch.randn(shape)
            torch.testing.assert_close(cm(x), model(x), rtol=1e-4, atol=1e-4)
