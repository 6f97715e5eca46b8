"""sextant on an NVIDIA GPU against eager PyTorch and ``torch.compile``: one markdown table.

Cases: GPT-2 (transformers' default ``GPT2Config()``: 12 layers, 768 wide, 50257 tokens) at
batch 8 × sequence 512 in fp32 and fp16, a 4096³ matrix product in fp32, fp16 and bf16 (the
half ones on tensor cores), a decode-shaped fp16 product 16×4096·4096×4096 (split-K), causal
fp16 attention with GPT-2-small's heads (batch 8, 12 × 64) at sequence 512 and 2048 against
torch's SDPA, and a softmax over 8192×8192 in fp32 and fp16. Times are medians of CUDA-event-timed
calls after warm-up; the error is the largest absolute difference between sextant's output and
eager's (same dtype).

The whole run must fit in ``--budget-s`` (scripts/gpu-check gives it what the tests leave of 8
minutes): sextant and eager run for every case first, then ``torch.compile`` for the cases whose
estimated Inductor compile time still fits, cheapest first; a skipped one says so in the table.
A case that fails is reported in its row (and its traceback on stderr) instead of ending the run.

    python -m sextant.tools.gpu_bench [--budget-s 300] [--cases gpt2-fp16,matmul-fp32] [--out FILE]
    python -m sextant.tools.gpu_bench --dry-run   # no GPU: tiny sizes through target='cuda-sim'

``--dry-run`` builds every case at a tiny size and runs it through ``cuda-sim`` (the same GPU
schedules, PTX and ptxas; kernels executed on the CPU), so everything up to the GPU calls is
known to work before a GPU is spent on it. The table goes to stdout, to ``--out``, and to
``$OUT/gpu_bench.md`` when ``OUT`` is set.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import sextant


class MatMul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


class Attention(nn.Module):
    """Causal SDPA, as GPT-2's attention with transformers' ``sdpa`` implementation calls it."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def attention_inputs(seq: int, tiny: bool) -> tuple[nn.Module, tuple]:
    """GPT-2-small's heads (12 × 64) at batch 8, or 1 × 2 heads × 80 tokens when ``tiny``."""
    torch.manual_seed(0)
    shape = (1, 2, 80, 64) if tiny else (8, 12, seq, 64)
    return Attention(), tuple(torch.randn(*shape) for _ in range(3))


class Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def gpt2_default(batch: int, seq: int, tiny: bool) -> tuple[nn.Module, tuple]:
    """transformers' ``GPT2Config()`` (12 layers; a 2-layer, 64-wide one when ``tiny``), random weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    from sextant.examples import GPT2Logits

    torch.manual_seed(0)
    extra = ({"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 500, "n_positions": 64, "bos_token_id": 0,
              "eos_token_id": 0} if tiny else {})
    config = GPT2Config(attn_implementation="eager", **extra)
    model = GPT2Logits(GPT2LMHeadModel(config)).eval()
    return model, (torch.randint(0, config.vocab_size, (batch, seq)),)


def decode_inputs(tiny: bool) -> tuple[nn.Module, tuple]:
    """A decode step's product: 16 token rows times a weight scaled like a Linear layer's (1/√K), so
    the outputs are O(1) and the error column compares like the other cases'."""
    k, n = (2048, 256) if tiny else (4096, 4096)
    return MatMul(), (torch.randn(16, k), torch.randn(k, n) / k**0.5)


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    build: Callable[[bool], tuple[nn.Module, tuple]]  # tiny -> (module, example args) on the CPU
    inductor_s: float  # rough torch.compile cost on the GPU machine, to stay inside the budget
    dynamic: Callable[[], dict] | None = None  # dynamic_shapes: sextant compiles one program for all sizes


def _cases() -> list[Case]:
    out = []
    for dt, tag in ((torch.float32, "fp32"), (torch.float16, "fp16")):
        out.append(Case(f"gpt2-12l-b8-s512-{tag}", dt,
                        lambda tiny: gpt2_default(2 if tiny else 8, 16 if tiny else 512, tiny), 90.0))
        if dt == torch.float16:  # the same model compiled once for every size, timed at b8 s512
            out.append(Case("gpt2-12l-b8-s512-fp16-symbolic", dt,
                            lambda tiny: gpt2_default(2 if tiny else 8, 16 if tiny else 512, tiny), 90.0,
                            dynamic=_symbolic_tokens))
        out.append(Case(f"matmul-4096-{tag}", dt,
                        lambda tiny: (MatMul(), (torch.randn(64 if tiny else 4096, 64 if tiny else 4096),
                                                 torch.randn(64 if tiny else 4096, 64 if tiny else 4096))), 15.0))
        if dt == torch.float16:  # tensor cores: bf16 too (the GEMM mapping's other input type)
            out.append(Case("matmul-4096-bf16", torch.bfloat16,
                            lambda tiny: (MatMul(), (torch.randn(64 if tiny else 4096, 64 if tiny else 4096),
                                                     torch.randn(64 if tiny else 4096, 64 if tiny else 4096))), 15.0))
        if dt == torch.float16:  # a decode step: 16 rows are 64 tiles of 64x64 for 132 SMs -> split-K
            out.append(Case("matmul-decode-16x4096x4096-fp16", dt, decode_inputs, 15.0))
        if dt == torch.float16:  # flash attention on tensor cores against torch's SDPA (FlashAttention-2)
            for seq, cost in ((512, 10.0), (2048, 15.0)):
                out.append(Case(f"attention-b8-h12-s{seq}-causal-fp16", dt,
                                lambda tiny, seq=seq: attention_inputs(seq, tiny), cost))
        out.append(Case(f"softmax-8192-{tag}", dt,
                        lambda tiny: (Softmax(), (torch.randn(64 if tiny else 8192, 64 if tiny else 8192),)), 10.0))
    return out


def _symbolic_tokens() -> dict:
    from torch.export import Dim

    return {"input_ids": {0: Dim("batch", min=1, max=8), 1: Dim("seq", min=1, max=1024)}}


@dataclass
class Row:
    case: str
    eager_ms: float | None = None
    sextant_ms: float | None = None
    inductor_ms: float | None = None
    max_err: float | None = None
    sextant_compile_s: float | None = None
    inductor_compile_s: float | None = None
    kernels: str = ""
    notes: list[str] = field(default_factory=list)
    profile: dict | None = None  # where the GPU time goes (models only): sextant.tools.bench.profile's dict


def _cast(model: nn.Module, args: tuple, dtype: torch.dtype, device: str) -> tuple[nn.Module, tuple]:
    model = model.to(device=device, dtype=dtype)
    return model, tuple(a.to(device, dtype) if a.is_floating_point() else a.to(device) for a in args)


def _time_ms(fn: Callable[[], object], cuda: bool, min_runs: int = 3, max_runs: int = 20,
             budget_s: float = 2.0) -> float:
    """Median milliseconds per call: CUDA events around each call on the GPU, wall time otherwise."""
    for _ in range(2):  # warm-up: first-call work (graph build, autotuning, allocator growth)
        fn()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or (len(times) < max_runs and time.perf_counter() - start < budget_s):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _max_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return (got.float() - expected.float()).abs().max().item()


def _fail_note(what: str, e: BaseException) -> str:
    traceback.print_exc(file=sys.stderr)
    return f"{what} failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def run_case(case: Case, dry_run: bool, row: Row) -> tuple[nn.Module, tuple, torch.Tensor] | None:
    """Eager and sextant for one case; returns (GPU model, args, eager output) for torch.compile."""
    device = "cpu" if dry_run else "cuda"
    target = "cuda-sim" if dry_run else "cuda"
    cpu_model, cpu_args = case.build(dry_run)
    model, args = _cast(copy.deepcopy(cpu_model), cpu_args, case.dtype, device)
    with torch.inference_mode():
        expected = model(*args)
        row.eager_ms = _time_ms(lambda: model(*args), cuda=not dry_run)
    try:
        # compiled from the CPU copy: the CUDA runtime uploads the weights once
        sm, sargs = _cast(cpu_model, cpu_args, case.dtype, "cpu")
        t0 = time.perf_counter()
        dynamic = case.dynamic() if case.dynamic is not None else None
        compiled = sextant.compile(sm, sargs, target=target, cache=False, dynamic_shapes=dynamic)  # stages read below
        if dynamic is not None:
            row.notes.append("one program for batch ≤ 8, seq ≤ 1024" if "program" in compiled.stages else
                             f"compiled per binding: {compiled.stages.get('per_binding')}")
        row.sextant_compile_s = time.perf_counter() - t0
        program = compiled.stages["program"]
        row.kernels = f"{len(program.launches)} ({len(program.kernels)})"
        mma = [k for k in program.kernels.values() if "tensor-core" in k.meta.get("mapping", "")]
        if mma:
            row.kernels += f", {len(mma)} tensor-core"
            res = compiled.stages.get("ptxas")
            if res is not None and getattr(res, "kernels", None):
                used = [res.kernels[k.name] for k in mma if k.name in res.kernels]
                if used:
                    row.notes.append(f"MMA kernels: ≤{max(r.registers for r in used)} registers, "
                                     f"{sum(r.spill_stores + r.spill_loads for r in used)} B spills")
        splits = [r.split(" runs as ")[1].split(",")[0] for r in program.rewrites if r.startswith("split-K")]
        if splits:
            row.notes.append("split-K: " + "; ".join(splits))
        got = compiled(*args)
        row.max_err = _max_err(got, expected)
        del got
        row.sextant_ms = _time_ms(lambda: compiled(*args), cuda=not dry_run)
        runner = compiled.stages.get("runner")
        if case.name.startswith("gpt2") and dynamic is None and hasattr(runner, "profile"):  # each launch timed
            from sextant.tools.bench import profile

            row.profile = profile(runner, program, compiled.flat_inputs(args, {}), row.sextant_ms)
        if runner is not None and getattr(runner, "image", "cubin") != "cubin":
            row.notes.append("PTX JIT-compiled by the driver" + (" (cubin refused)" if runner.cubin_error else ""))
    except Exception as e:
        row.notes.append(_fail_note("sextant", e))
    return model, args, expected


def run_inductor(model: nn.Module, args: tuple, expected: torch.Tensor, dry_run: bool, row: Row) -> None:
    try:
        torch._dynamo.reset()
        fn = torch.compile(model)
        t0 = time.perf_counter()
        with torch.inference_mode():
            got = fn(*args)
            if not dry_run:
                torch.cuda.synchronize()
            row.inductor_compile_s = time.perf_counter() - t0
            err = _max_err(got, expected)
            if err > 0 and row.max_err is not None:
                row.notes.append(f"torch.compile max err {err:.1e}")
            row.inductor_ms = _time_ms(lambda: fn(*args), cuda=not dry_run)
    except Exception as e:
        row.notes.append(_fail_note("torch.compile", e))


def _fmt(v: float | None, spec: str = ".2f") -> str:
    return "–" if v is None else format(v, spec)


def table(rows: list[Row], device: str) -> str:
    head = ("| case | eager ms | sextant cuda ms | × eager | torch.compile ms | max abs err | sextant compile s | "
            "Inductor compile s | kernels (unique) | GPU | notes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ratio = r.sextant_ms / r.eager_ms if r.sextant_ms and r.eager_ms else None
        lines.append(f"| {r.case} | {_fmt(r.eager_ms, '.3f')} | {_fmt(r.sextant_ms, '.3f')} | {_fmt(ratio)} | "
                     f"{_fmt(r.inductor_ms, '.3f')} | {_fmt(r.max_err, '.1e')} | {_fmt(r.sextant_compile_s, '.1f')} | "
                     f"{_fmt(r.inductor_compile_s, '.1f')} | {r.kernels} | {device} | {'; '.join(r.notes)} |")
    return "\n".join(lines)


KINDS = ("matmul", "attention", "reduce", "elementwise")


def profile_table(rows: list[Row]) -> str:
    """Where sextant's GPU time goes per model: each launch timed between CUDA events
    (``CudaRunner.profile``), summed per kernel kind; *gaps* is the rest of a call (launch gaps
    inside the CUDA graph, the host's per-call work). Empty when no row was profiled."""
    profiled = [r for r in rows if r.profile]
    if not profiled:
        return ""

    def cell(ms: float | None, total: float) -> str:
        return "–" if not ms else f"{ms:.3f} ({100 * ms / total:.0f}%)"

    head = "| case | sextant ms | " + " | ".join(KINDS) + " | other | gaps | slowest launch |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in profiled:
        p, total = r.profile, r.sextant_ms or 0.0
        kinds = dict(p["kinds"])
        other = sum(v for k, v in kinds.items() if k not in KINDS)
        ms, what = p["worst"]
        lines.append(f"| {r.case} | {total:.3f} | " + " | ".join(cell(kinds.get(k), total) for k in KINDS)
                     + f" | {cell(other, total)} | {cell(p['overhead_ms'], total)} | {ms:.3f} ms {what} |")
    return "\n".join(lines)


def environment(dry_run: bool) -> tuple[str, str]:
    """(GPU name, a one-line description of the software) for the table's caption."""
    if dry_run or not torch.cuda.is_available():
        device = f"none (dry run on {platform.machine()} CPU, target cuda-sim)"
    else:
        major, minor = torch.cuda.get_device_capability()
        device = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    try:
        import llvmlite

        llvm = llvmlite.__version__
    except Exception:
        llvm = "?"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return device, (f"Python {platform.python_version()}, torch {torch.__version__}, llvmlite {llvm}; "
                    f"eager fp32 matmul TF32 {'on' if tf32 else 'off'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-s", type=float, default=300.0, help="wall-clock budget for the whole benchmark")
    ap.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    ap.add_argument("--no-inductor", action="store_true", help="skip torch.compile")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: tiny sizes through target='cuda-sim'")
    ap.add_argument("--out", type=Path, help="also write the table here")
    opts = ap.parse_args(argv)
    if not opts.dry_run and not torch.cuda.is_available():
        print("gpu_bench: no CUDA GPU (torch.cuda.is_available() is False); use --dry-run to check the "
              "benchmark's CPU-side steps", file=sys.stderr)
        return 2
    start = time.perf_counter()
    wanted = [s for s in opts.cases.split(",") if s]
    cases = [c for c in _cases() if not wanted or any(w in c.name for w in wanted)]
    rows: dict[str, Row] = {}
    for_inductor: list[tuple[Case, nn.Module, tuple, torch.Tensor]] = []
    out_paths = [opts.out] if opts.out else []
    if os.environ.get("OUT"):
        out_paths.append(Path(os.environ["OUT"]) / "gpu_bench.md")

    def report(final: bool) -> str:
        """The table so far, written to the output files after every case (a killed run keeps its rows)."""
        device, software = environment(opts.dry_run)
        state = f"the whole run took {time.perf_counter() - start:.0f} s" if final else "INCOMPLETE run"
        text = (f"{software}. Medians of timed calls (CUDA events on the GPU) after 2 warm-ups; max abs err is "
                f"sextant vs eager (same dtype); {state}.\n\n" + table([rows[c.name] for c in cases], device) + "\n")
        where = profile_table([rows[c.name] for c in cases])
        if where:
            text += ("\nWhere sextant's GPU time goes (each launch timed between CUDA events, 20 back to back, "
                     "after a forward; summed per kernel kind):\n\n" + where + "\n")
        for path in out_paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return text

    for case in cases:
        row = rows[case.name] = Row(case.name)
    for case in cases:
        row = rows[case.name]
        if time.perf_counter() - start > opts.budget_s - 20:
            row.notes.append("not run: the benchmark's time budget was spent")
            continue
        print(f"[{time.perf_counter() - start:6.1f}s] {case.name}: eager and sextant", file=sys.stderr, flush=True)
        try:
            built = run_case(case, opts.dry_run, row)
        except Exception as e:
            row.notes.append(_fail_note("eager", e))
            built = None
        if built is not None:
            for_inductor.append((case, *built))
        if not opts.dry_run:
            torch.cuda.empty_cache()
        report(final=False)
    for case, model, args, expected in sorted(for_inductor, key=lambda t: t[0].inductor_s):
        row = rows[case.name]
        left = opts.budget_s - (time.perf_counter() - start)
        if opts.no_inductor:
            row.notes.append("torch.compile not run (--no-inductor)")
        elif left < case.inductor_s + 10:
            row.notes.append(f"torch.compile skipped: ~{case.inductor_s:.0f} s to compile, {left:.0f} s of budget left")
        else:
            print(f"[{time.perf_counter() - start:6.1f}s] {case.name}: torch.compile", file=sys.stderr, flush=True)
            run_inductor(model, args, expected, opts.dry_run, row)
            report(final=False)
    print(report(final=True))
    for path in out_paths:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
