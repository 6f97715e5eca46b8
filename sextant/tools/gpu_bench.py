"""sextant on an NVIDIA GPU against eager PyTorch and ``torch.compile``: one markdown table.

Cases: GPT-2 (transformers' default ``GPT2Config()``: 12 layers, 768 wide, 50257 tokens) at
batch 8 × sequence 512 in fp32 and fp16, a 4096³ matrix product in fp32, fp16 and bf16 (the
half ones on tensor cores), a decode-shaped fp16 product 16×4096·4096×4096 (split-K), causal
fp16 attention with GPT-2-small's heads (batch 8, 12 × 64) at sequence 512 and 2048 against
torch's SDPA, a softmax over 8192×8192 in fp32 and fp16, and LLM decoding: the Llama-style
decoder of :mod:`sextant.decoder` at GPT-2-small size (``DecoderConfig.llama_100m()``) in fp16
and bf16, batch 1, a 128-token prefill then 128 greedy decode steps on its KV caches (updated in
place), against eager and ``torch.compile(mode="reduce-overhead")`` (Inductor with CUDA graphs;
sextant's runner replays CUDA graphs too), and a training step (forward, backward, SGD with
momentum) of a 4-layer GPT-2-small-width LM at batch 8 × 256 in fp32 (``gpu_bench_train.py``).
Times are medians of CUDA-event-timed calls after
warm-up (decoding: ms per decode token; a second table has each path's prefill ms and how many of
its tokens equal eager's); the error is the largest absolute difference between sextant's output
(decoding: its logits) and eager's (same dtype).

The whole run must fit in ``--budget-s`` (scripts/gpu-check gives it what the tests leave of 8
minutes): sextant and eager run for every case first, then ``torch.compile`` for the cases whose
estimated Inductor compile time still fits, cheapest first; a skipped one says so in the table.
A case that fails is reported in its row (and its traceback on stderr) instead of ending the run.

    python -m sextant.tools.gpu_bench [--budget-s 300] [--cases gpt2-fp16,matmul-fp32] [--out FILE]
    python -m sextant.tools.gpu_bench --dry-run   # no GPU: tiny sizes through target='cuda-sim'

``--dry-run`` builds every case at a tiny size and runs it through ``cuda-sim`` (the same GPU
schedules, PTX and ptxas; kernels executed on the CPU), so everything up to the GPU calls is
known to work before a GPU is spent on it (the decode cases leave ``torch.compile`` out there: two
Inductor graphs take 15–45 s on a small CPU). The table goes to stdout, to ``--out``, and to
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
from sextant.tools.gpu_bench_train import run_train, run_train_inductor, train_inputs


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


class Bottleneck(nn.Module):
    """A ResNet-50 bottleneck block (1×1 reduce, 3×3, 1×1 expand, BatchNorm, residual): convolutions
    on tensor cores — the implicit GEMM (mma.sync, or wgmma on sm_90a) — without torchvision."""

    def __init__(self, width: int = 64, expansion: int = 4) -> None:
        super().__init__()
        c = width * expansion

        def unit(cin: int, cout: int, k: int) -> nn.Sequential:
            return nn.Sequential(nn.Conv2d(cin, cout, k, padding=k // 2, bias=False), nn.BatchNorm2d(cout))

        self.reduce, self.conv, self.expand = unit(c, width, 1), unit(width, width, 3), unit(width, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.conv(torch.relu(self.reduce(x))))
        return torch.relu(self.expand(y) + x)


def bottleneck_inputs(tiny: bool) -> tuple[nn.Module, tuple]:
    """ResNet-50's first-stage block (256 → 64 → 256 channels) at batch 32 × 56 × 56, or 2 × 8 × 8."""
    torch.manual_seed(0)
    return Bottleneck().eval(), (torch.randn(2 if tiny else 32, 256, 8 if tiny else 56, 8 if tiny else 56),)


class Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def gpt2_default(batch: int, seq: int, tiny: bool) -> tuple[nn.Module, tuple]:
    """transformers' ``GPT2Config()`` (12 layers; when ``tiny`` 2 layers, 128 wide in 2 heads of 64 — GPT-2's
    head size, which the Hopper attention needs), random weights."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import GPT2Config, GPT2LMHeadModel

    from sextant.examples import GPT2Logits

    torch.manual_seed(0)
    extra = ({"n_layer": 2, "n_embd": 128, "n_head": 2, "vocab_size": 500, "n_positions": 64, "bos_token_id": 0,
              "eos_token_id": 0} if tiny else {})
    config = GPT2Config(attn_implementation="eager", **extra)
    model = GPT2Logits(GPT2LMHeadModel(config)).eval()
    return model, (torch.randint(0, config.vocab_size, (batch, seq)),)


def decode_inputs(tiny: bool) -> tuple[nn.Module, tuple]:
    """A decode step's product: 16 token rows times a weight scaled like a Linear layer's (1/√K), so
    the outputs are O(1) and the error column compares like the other cases'."""
    k, n = (2048, 256) if tiny else (4096, 4096)
    return MatMul(), (torch.randn(16, k), torch.randn(k, n) / k**0.5)


def llm_decode_inputs(tiny: bool) -> tuple[nn.Module, tuple]:
    """The Llama-style decoder of :mod:`sextant.decoder` at GPT-2-small size
    (``DecoderConfig.llama_100m()``: 12 layers × 768, 12 heads over 4 K/V heads, vocabulary 32000,
    static cache 256) at batch 1, with a 128-token prompt and 128 greedy decode steps (the whole
    cache); ``DecoderConfig.tiny()`` with 8 tokens and 4 steps when ``tiny``. The args are
    :func:`~sextant.decoder.greedy_generate`'s: (prompt ids, decode steps)."""
    from sextant.decoder import Decoder, DecoderConfig

    config = DecoderConfig.tiny() if tiny else DecoderConfig.llama_100m()
    prompt, steps = (8, 4) if tiny else (128, 128)
    ids = torch.randint(0, config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    return Decoder(config, batch=1, seed=0).eval(), (ids, steps)


@dataclass(frozen=True)
class Case:
    name: str
    dtype: torch.dtype
    build: Callable[[bool], tuple[nn.Module, tuple]]  # tiny -> (module, example args) on the CPU
    inductor_s: float  # rough torch.compile cost on the GPU machine, to stay inside the budget
    dynamic: Callable[[], dict] | None = None  # dynamic_shapes: sextant compiles one program for all sizes
    # "forward": one call of the module on its args (run_case, run_inductor); "decode": a Decoder and
    # greedy_generate's (prompt ids, steps): a prefill, then a loop of decode calls on its KV caches
    # (run_decode, run_decode_inductor); "train": a training step (gpu_bench_train.py; see RUNNERS)
    kind: str = "forward"
    dry_run_inductor: bool = True  # False: torch.compile is too slow on a CPU to be part of --dry-run


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
            out.append(Case("resnet-bottleneck-b32-fp16", dt, bottleneck_inputs, 30.0))  # convs on tensor cores
        out.append(Case(f"softmax-8192-{tag}", dt,
                        lambda tiny: (Softmax(), (torch.randn(64 if tiny else 8192, 64 if tiny else 8192),)), 10.0))
    # LLM decoding: prefill + greedy decode steps, the KV caches updated in place, half precision only;
    # torch.compile with CUDA graphs (two Inductor graphs: ~45 s at the tiny size on a 2-core CPU, so not
    # in --dry-run)
    for dt, tag in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        out.append(Case(f"llm-decode-100m-b1-p128-n128-{tag}", dt, llm_decode_inputs, 45.0, kind="decode",
                        dry_run_inductor=False))
    # training: forward, backward and the optimizer step of a GPT-2 LM in fp32 (gpu_bench_train.py)
    out.append(Case("gpt2-4l-b8-s256-train-fp32", torch.float32, train_inputs, 120.0, kind="train",
                    dry_run_inductor=False))
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
    decode: dict[str, dict] | None = None  # decode cases: per path (eager, sextant, torch.compile), decode_table's


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


def describe_program(compiled: sextant.CompiledModule, row: Row) -> None:
    """The kernels column (launches, unique kernels, tensor-core ones) and the notes on a compiled
    program: its MMA kernels' registers and spills, split-K rewrites, a PTX the driver JIT-compiled."""
    program = compiled.stages["program"]
    row.kernels = f"{len(program.launches)} ({len(program.kernels)})"
    mma = [k for k in program.kernels.values() if "tensor-core" in k.meta.get("mapping", "")
           or "wgmma" in k.meta.get("mapping", "")]
    if mma:
        row.kernels += f", {len(mma)} tensor-core"
        wgmma = sum("wgmma" in k.meta.get("mapping", "") for k in mma)
        if wgmma:
            row.kernels += f" ({wgmma} wgmma+TMA)"
        res = compiled.stages.get("ptxas")
        if res is not None and getattr(res, "kernels", None):
            used = [res.kernels[k.name] for k in mma if k.name in res.kernels]
            if used:
                row.notes.append(f"MMA kernels: ≤{max(r.registers for r in used)} registers, "
                                 f"{sum(r.spill_stores + r.spill_loads for r in used)} B spills")
    splits = [r.split(" runs as ")[1].split(",")[0] for r in program.rewrites if r.startswith("split-K")]
    if splits:
        row.notes.append("split-K: " + "; ".join(splits))
    runner = compiled.stages.get("runner")
    if runner is not None and getattr(runner, "image", "cubin") != "cubin":
        row.notes.append("PTX JIT-compiled by the driver" + (" (cubin refused)" if runner.cubin_error else ""))


ARCH: str | None = None  # --arch: the GPU architecture to compile for (default: the device's, sm_90 on Hopper)


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
        compiled = sextant.compile(sm, sargs, target=target, cache=False, dynamic_shapes=dynamic,  # stages read below
                                   **({"arch": ARCH} if ARCH else {}))
        if dynamic is not None:
            row.notes.append("one program for batch ≤ 8, seq ≤ 1024" if "program" in compiled.stages else
                             f"compiled per binding: {compiled.stages.get('per_binding')}")
        row.sextant_compile_s = time.perf_counter() - t0
        program = compiled.stages["program"]
        describe_program(compiled, row)
        got = compiled(*args)
        row.max_err = _max_err(got, expected)
        del got
        row.sextant_ms = _time_ms(lambda: compiled(*args), cuda=not dry_run)
        runner = compiled.stages.get("runner")
        if case.name.startswith("gpt2") and dynamic is None and hasattr(runner, "profile"):  # each launch timed
            from sextant.tools.bench import profile

            row.profile = profile(runner, program, compiled.flat_inputs(args, {}), row.sextant_ms)
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


# ---------------------------------------------------------------- LLM decoding: a loop of calls with state

# Largest logit error (the decoder's logits have unit scale; sextant or torch.compile vs eager) still
# taken as the dtype's rounding: GPT-2 fp16's logits are ~5e-3 off eager's, bf16 keeps 3 bits fewer.
# A token that differs where the logit error is within this is a near-tie; beyond it, a mismatch
LOGIT_TOL = {torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}


class _StepTimer:
    """A step function for :func:`~sextant.decoder.greedy_generate` that times each call (CUDA
    events on the GPU, read after the loop: no sync inside it; wall time otherwise) and keeps an
    f32 copy of each call's last-position logits (after the call's end is recorded: not timed)."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], cuda: bool) -> None:
        self.fn, self.cuda = fn, cuda
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.wall_ms: list[float] = []
        self.logits: list[torch.Tensor] = []

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = self.fn(ids, pos)
            end.record()
            self.events.append((begin, end))
        else:
            t0 = time.perf_counter()
            out = self.fn(ids, pos)
            self.wall_ms.append((time.perf_counter() - t0) * 1e3)
        self.logits.append(out[:, -1].to(torch.float32, copy=True))
        return out

    def times_ms(self) -> list[float]:
        if not self.cuda:
            return self.wall_ms
        torch.cuda.synchronize()
        return [begin.elapsed_time(end) for begin, end in self.events]


@dataclass
class Generation:
    """One path's greedy generation: the prefill's and a decode step's median times, the warm-up's
    seconds (first calls: Inductor compiles there), the tokens chosen (``[B, steps + 1]``, CPU)
    and each call's last-position logits (``[B, vocab]`` f32, on the device)."""

    prefill_ms: float
    decode_ms: float
    warmup_s: float
    tokens: torch.Tensor
    logits: list[torch.Tensor]


@torch.no_grad()
def generate(step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], model: nn.Module,
             prompt: torch.Tensor, steps: int, cuda: bool) -> Generation:
    """Warm up ``step_fn`` (two short generations: every shape's first calls), time its prefill
    (:func:`_time_ms`), then one timed greedy generation of ``steps`` tokens from a zeroed cache."""
    from sextant.decoder import greedy_generate

    t0 = time.perf_counter()
    for _ in range(2):
        greedy_generate(step_fn, prompt, min(steps, 2))
    if cuda:
        torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    positions = torch.arange(prompt.shape[1], device=prompt.device)
    prefill_ms = _time_ms(lambda: step_fn(prompt, positions), cuda, budget_s=1.0)
    model.reset_cache()
    timer = _StepTimer(step_fn, cuda)
    tokens = greedy_generate(timer, prompt, steps)
    times = timer.times_ms()
    return Generation(prefill_ms, statistics.median(times[1:]), warmup_s, tokens.cpu(), timer.logits)


def compare_generation(got: Generation, ref: Generation, tol: float) -> dict:
    """``got``'s tokens and logits against eager's (``ref``): how many tokens are equal before the
    first difference (in any sequence), and the largest logit error over the calls whose inputs
    were still eager's (up to and including the call that chose the first differing token). A
    difference is a near-tie when the logit error at its call is within ``tol``."""
    n = ref.tokens.shape[1]
    differs = (got.tokens != ref.tokens).any(0)
    same = int(differs.int().argmax()) if bool(differs.any()) else n
    errs = [_max_err(got.logits[i], ref.logits[i]) for i in range(min(same + 1, n))]
    out = {"equal": same, "of": n, "err": max(errs), "within_tol": max(errs) <= tol}
    if same < n:
        b = int((got.tokens[:, same] != ref.tokens[:, same]).int().argmax())
        want, chose = int(ref.tokens[b, same]), int(got.tokens[b, same])
        gap = (ref.logits[same][b, want] - ref.logits[same][b, chose]).item()
        out["near_tie"] = errs[-1] <= tol
        out["diff"] = (f"token {same}: {chose} for eager's {want}, whose logits are {gap:.1e} apart there "
                       f"(logit err {errs[-1]:.1e})")
    return out


def _tokens_note(what: str, cmp: dict, tol: float) -> str:
    equal = f"{what}: {cmp['equal']}/{cmp['of']} tokens equal to eager's"
    if "diff" not in cmp:
        note = equal
    elif cmp["near_tie"]:
        note = f"{equal}, then a near-tie ({cmp['diff']} ≤ tolerance {tol:.0e})"
    else:
        note = f"**MISMATCH**: {equal} ({cmp['diff']} > tolerance {tol:.0e})"
    if not cmp["within_tol"]:
        note += f"; **logits off**: max err {cmp['err']:.1e} > {tol:.0e}"
    return note


def _decode_entry(gen: Generation, compile_s: float | None, cmp: dict | None) -> dict:
    return {"prefill_ms": gen.prefill_ms, "decode_ms": gen.decode_ms, "compile_s": compile_s,
            "tokens_per_s": 1e3 * gen.tokens.shape[0] / gen.decode_ms if gen.decode_ms else None,
            "tokens": "reference" if cmp is None else f"{cmp['equal']}/{cmp['of']}",
            "err": None if cmp is None else cmp["err"]}


def run_decode(case: Case, dry_run: bool, row: Row) -> tuple[nn.Module, torch.Tensor, int, Generation]:
    """Eager and sextant for a decode case: the model (and its KV caches) cast to the case's dtype
    on the device; sextant compiles a prefill-shaped and a decode-shaped program from the same
    module object (both update its caches in place); each path is warmed up, its prefill timed,
    then one greedy generation timed call by call. The row's times are ms per decode token; the
    error is the logits' against eager's. Returns (model, prompt, steps, eager's generation)."""
    device = "cpu" if dry_run else "cuda"
    target = "cuda-sim" if dry_run else "cuda"
    cpu_model, (cpu_prompt, steps) = case.build(dry_run)
    model = cpu_model.to(device=device, dtype=case.dtype)
    model.setup_cache(cpu_prompt.shape[0], case.dtype)  # the caches in the case's dtype, on the device
    prompt = cpu_prompt.to(device)
    batch, length = prompt.shape
    tol = LOGIT_TOL[case.dtype]
    ref = generate(model, model, prompt, steps, cuda=not dry_run)
    row.eager_ms = ref.decode_ms
    row.decode = {"eager": {**_decode_entry(ref, None, None), "shape": f"{batch} × {length} + {steps}"}}
    row.notes.append(f"ms per decode token (median of {steps} greedy steps, batch {batch}, after the {length}-token "
                     f"prefill; prefill times below); max abs err: logits")
    try:
        t0 = time.perf_counter()
        # one module object: both programs read and write its cache buffers
        prefill = sextant.compile(model, (prompt, torch.arange(length, device=device)), target=target, cache=False)
        decode = sextant.compile(model, (prompt[:, :1], torch.tensor([length], device=device)), target=target,
                                 cache=False)
        row.sextant_compile_s = time.perf_counter() - t0
        describe_program(decode, row)
        row.notes.append(f"kernels: the decode step's (prefill: {len(prefill.stages['program'].launches)} launches)")

        def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return (prefill if ids.shape[1] == length else decode)(ids, pos)

        got = generate(step, model, prompt, steps, cuda=not dry_run)
        cmp = compare_generation(got, ref, tol)
        row.sextant_ms, row.max_err = got.decode_ms, cmp["err"]
        row.decode["sextant"] = _decode_entry(got, row.sextant_compile_s, cmp)
        row.notes.append(_tokens_note("sextant", cmp, tol))
        copies = prefill.full_write_backs + decode.full_write_backs
        if copies:
            row.notes.append(f"**{copies} caches copied back** (not updated in place)")
    except Exception as e:
        row.notes.append(_fail_note("sextant", e))
    return model, prompt, steps, ref


def run_decode_inductor(model: nn.Module, prompt: torch.Tensor, steps: int, ref: Generation, dry_run: bool,
                        row: Row) -> None:
    """``torch.compile(mode="reduce-overhead")``: Inductor with CUDA graphs, static shapes (a graph
    for the prefill, one for the decode step), each call marked as a new step of CUDA graph trees
    (the previous call's logits are not read after it). Compile time: the warm-up's."""
    try:
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(model, mode="reduce-overhead", dynamic=False)

        def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            return fn(ids, pos)

        got = generate(step, model, prompt, steps, cuda=not dry_run)
        tol = LOGIT_TOL[next(model.parameters()).dtype]
        cmp = compare_generation(got, ref, tol)
        row.inductor_ms, row.inductor_compile_s = got.decode_ms, got.warmup_s
        if row.decode is not None:
            row.decode["torch.compile"] = _decode_entry(got, got.warmup_s, cmp)
        row.notes.append(_tokens_note("torch.compile", cmp, tol))
        skips = counters["inductor"]["cudagraph_skips"]
        if skips and not dry_run:
            row.notes.append(f"torch.compile skipped CUDA graphs for {skips} graph(s)")
    except Exception as e:
        row.notes.append(_fail_note("torch.compile", e))


# what runs a case of each kind: (eager and sextant, returning what the second needs; torch.compile)
RUNNERS: dict[str, tuple[Callable[..., tuple], Callable[..., None]]] = {
    "forward": (run_case, run_inductor),
    "decode": (run_decode, run_decode_inductor),
    "train": (run_train, run_train_inductor),
}


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


DECODE_CAPTION = (
    "LLM decoding (batch × prompt + greedy steps): prefill ms is the median of timed prefill calls; decode "
    "ms/token the median step of one greedy generation after two warm-up ones (CUDA events around each call, "
    "the argmax between calls not timed); tokens: how many of the generated tokens equal eager's before the "
    "first difference; max abs logit err: against eager's logits, over the calls before that difference "
    "(inputs still eager's); compile s: sextant's two programs, torch.compile's warm-up.")


def decode_table(rows: list[Row]) -> str:
    """The decode cases' prefill and decode times, tokens and logit errors, one line per path."""
    lines = []
    for r in rows:
        for path, d in (r.decode or {}).items():
            lines.append(f"| {r.case} | {path} | {r.decode['eager']['shape']} | {_fmt(d['prefill_ms'], '.3f')} | "
                         f"{_fmt(d['decode_ms'], '.3f')} | {_fmt(d['tokens_per_s'], '.0f')} | {d['tokens']} | "
                         f"{_fmt(d['err'], '.1e')} | {_fmt(d['compile_s'], '.1f')} |")
    if not lines:
        return ""
    head = ("| case | path | batch × prompt + steps | prefill ms | decode ms/token | tokens/s | "
            "tokens equal to eager's | max abs logit err | compile s |")
    return "\n".join([head, "|" + "---|" * (head.count("|") - 1), *lines])


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
    ap.add_argument("--arch", help="compile for this architecture, e.g. sm_90a (Hopper's wgmma + TMA GEMMs); "
                                   "default: the device's")
    opts = ap.parse_args(argv)
    global ARCH
    ARCH = opts.arch
    if not opts.dry_run and not torch.cuda.is_available():
        print("gpu_bench: no CUDA GPU (torch.cuda.is_available() is False); use --dry-run to check the "
              "benchmark's CPU-side steps", file=sys.stderr)
        return 2
    start = time.perf_counter()
    wanted = [s for s in opts.cases.split(",") if s]
    cases = [c for c in _cases() if not wanted or any(w in c.name for w in wanted)]
    rows: dict[str, Row] = {}
    for_inductor: list[tuple[Case, tuple]] = []  # each case's runner's result, for its torch.compile runner
    out_paths = [opts.out] if opts.out else []
    if os.environ.get("OUT"):
        out_paths.append(Path(os.environ["OUT"]) / (f"gpu_bench_{opts.arch}.md" if opts.arch else "gpu_bench.md"))

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
        decoding = decode_table([rows[c.name] for c in cases])
        if decoding:
            text += f"\n{DECODE_CAPTION}\n\n{decoding}\n"
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
            built = RUNNERS[case.kind][0](case, opts.dry_run, row)
        except Exception as e:
            row.notes.append(_fail_note("eager", e))
            built = None
        if built is not None:
            for_inductor.append((case, built))
        if not opts.dry_run:
            torch.cuda.empty_cache()
        report(final=False)
    for case, built in sorted(for_inductor, key=lambda t: t[0].inductor_s):
        row = rows[case.name]
        left = opts.budget_s - (time.perf_counter() - start)
        if opts.no_inductor:
            row.notes.append("torch.compile not run (--no-inductor)")
        elif opts.dry_run and not case.dry_run_inductor:
            row.notes.append("torch.compile not run in --dry-run (too slow on a CPU)")
        elif left < case.inductor_s + 10:
            row.notes.append(f"torch.compile skipped: ~{case.inductor_s:.0f} s to compile, {left:.0f} s of budget left")
        else:
            print(f"[{time.perf_counter() - start:6.1f}s] {case.name}: torch.compile", file=sys.stderr, flush=True)
            RUNNERS[case.kind][1](*built, opts.dry_run, row)
            report(final=False)
    print(report(final=True))
    for path in out_paths:
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
