"""LLM decoding with a static KV cache: ``python -m sextant.tools.decode_bench``.

The workload of :mod:`sextant.decoder` (a Llama-style ~100M decoder, fp32, on the CPU): a prefill
of ``--prompt`` tokens, then ``--steps`` greedy one-token decode steps, at each ``--batch``, run
by eager PyTorch, by ``torch.compile`` (Inductor, default mode, static shapes: one graph for the
prefill shape, one for the decode shape, both compiled and warmed up before timing) and by sextant
(``sextant.compile`` once per shape, on the same module object so both programs share its cache
buffers). Each path runs in its own process (its peak memory is its own, and Inductor's compile
workers cannot land in another path's timings), on the same seeded weights and prompt; the
tokens each path generates are checked against eager's.

Reported per path and batch: prefill ms and tokens/s; decode ms per step (one token per sequence:
the median over the steps) and tokens/s; the decode step's ratio to the memory-bandwidth bound;
compile (or warm-up) time; memory: the peak resident set of the whole process (``VmHWM``: model,
compile and generation) and how far the resident set rose above its level at the start of the
timed generation (``VmHWM`` after resetting it through ``/proc/self/clear_refs``: the generation's
own working memory — activations, logits, the compiled program's temporaries — not the weights or
the caches, which are resident before it, nor memory the allocator kept from the warm-up calls
and reuses). Timings are of a machine shared with whatever else runs: under load, eager's and
Inductor's OpenMP threads spin-wait for cores and slow down many times over.

The bound: a decode step reads every weight once (the LM head, tied to the embedding, reads the
whole table; the embedding lookup only its rows) plus, per layer, the whole K and V caches
(attention runs over the full static cache, masked) — bytes ÷ the machine's memory bandwidth,
measured here as a large tensor copy (bytes read + bytes written per second; a pure read, a sum,
is shown as well). No implementation of this model can step faster than that on this machine.

    python -m sextant.tools.decode_bench [--config 100m|tiny] [--batch 1,4] [--prompt 128] [--steps 128]
    python -m sextant.tools.decode_bench --quick     # tiny config, a few steps: a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sextant.decoder import Decoder, DecoderConfig, greedy_generate

PATHS = ("eager", "inductor", "sextant")
CONFIGS: dict[str, Callable[[], DecoderConfig]] = {"100m": DecoderConfig.llama_100m, "tiny": DecoderConfig.tiny}
SEED = 0


def _prompt(config: DecoderConfig, batch: int, length: int) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(SEED + 1))


# ---------------------------------------------------------------- one path, in a child process


def _rss_mib(field: str) -> float | None:
    """``VmRSS``/``VmHWM`` of this process from /proc (None where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS (Linux ≥ 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _step_fn(path: str, model: Decoder, prefill: tuple[torch.Tensor, torch.Tensor],
             decode: tuple[torch.Tensor, torch.Tensor]) -> tuple[Callable[..., torch.Tensor], float]:
    """The callable that runs ``path`` on ``model``'s cache, and its compile time (0 for eager;
    Inductor compiles lazily, so its time is that of the first prefill and decode calls)."""
    if path == "eager":
        return model, 0.0
    if path == "inductor":
        torch._dynamo.reset()
        # dynamic=False: one static graph per shape (as for sextant), not a symbolic one after the
        # second shape is seen
        opt = torch.compile(model, dynamic=False)
        t0 = time.perf_counter()
        with torch.no_grad():
            opt(*prefill)
            opt(*decode)
        seconds = time.perf_counter() - t0
        # Inductor's compile workers stay alive (and busy) after it returns; on 2 cores they land
        # in the timings (as bench.py found): stop them
        from torch._inductor.async_compile import shutdown_compile_workers

        shutdown_compile_workers()
        return opt, seconds
    if path == "sextant":
        import sextant

        t0 = time.perf_counter()
        # Both programs compiled from the same module object: they read and write its cache buffers
        pre = sextant.compile(model, prefill, target="cpu")
        dec = sextant.compile(model, decode, target="cpu")
        seconds = time.perf_counter() - t0
        prefill_len = prefill[0].shape[1]

        def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            return (pre if ids.shape[1] == prefill_len else dec)(ids, pos)

        return step, seconds
    raise ValueError(f"unknown path {path!r}")


class _Timed:
    """Wraps a step function, timing each call (the first is the prefill)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn, self.seconds = fn, []  # type: ignore[var-annotated]

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self.fn(ids, pos)
        self.seconds.append(time.perf_counter() - t0)
        return out


def run_path(path: str, config_name: str, batch: int, prompt: int, steps: int) -> dict[str, object]:
    """Build the model, compile ``path``, warm up, time one generation; a JSON-able result (with
    ``error`` instead of timings where ``path`` could not run the model)."""
    config = CONFIGS[config_name]()
    model = Decoder(config, batch=batch, seed=SEED).eval()
    ids = _prompt(config, batch, prompt)
    prefill = (ids, torch.arange(prompt))
    decode = (ids[:, :1].clone(), torch.tensor([prompt]))
    result: dict[str, object] = {"path": path, "batch": batch, "rss_model_mib": _rss_mib("VmRSS")}
    try:
        with torch.no_grad():
            fn, compile_s = _step_fn(path, model, prefill, decode)
            t0 = time.perf_counter()
            fn(*prefill)  # warm up (again, for Inductor: its first calls compiled)
            fn(*decode)
            fn(*decode)
            result["warmup_s"] = time.perf_counter() - t0
            prefill_s = []
            for _ in range(2):  # two more prefill samples; the third is the generation's own
                model.reset_cache()
                t0 = time.perf_counter()
                fn(*prefill)
                prefill_s.append(time.perf_counter() - t0)
            model.reset_cache()
            timed = _Timed(fn)
            peak_before = _rss_mib("VmHWM")  # model + compile + warm-up
            rss0 = _rss_mib("VmRSS")
            reset = _reset_peak_rss()
            tokens = greedy_generate(timed, ids, steps, max_cache_len=config.max_cache_len)
            hwm = _rss_mib("VmHWM")
    except Exception as e:  # a path that cannot run the model is reported (n/a and why), not fatal
        msg = str(e).strip().splitlines()
        result["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}"
        result["peak_rss_mib"] = _rss_mib("VmHWM")
        return result
    result.update(
        compile_s=compile_s,
        prefill_ms=1e3 * statistics.median(prefill_s + timed.seconds[:1]),
        decode_ms=1e3 * statistics.median(timed.seconds[1:]) if steps else None,
        decode_ms_mean=1e3 * statistics.fmean(timed.seconds[1:]) if steps else None,
        tokens=tokens.tolist(),
        # not ru_maxrss: Linux carries it over exec from the parent (whose bandwidth test peaks at 1 GB)
        peak_rss_mib=max(x for x in (peak_before, hwm, 0.0) if x is not None),
        generate_delta_mib=(hwm - rss0) if reset and hwm is not None and rss0 is not None else None,
    )
    return result


# ---------------------------------------------------------------- the parent: bandwidth, bound, table


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> tuple[float, float]:
    """The machine's memory bandwidth in GB/s, best of ``repeats``: a ``mib``-MiB tensor copied
    (bytes read + bytes written per second) and summed (bytes read per second)."""
    n = mib * 2**20 // 4
    src = torch.ones(n)
    dst = torch.empty_like(src)
    dst.copy_(src)  # pages touched before timing
    best_copy = best_read = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.sum()
        best_read = min(best_read, time.perf_counter() - t0)
    nbytes = n * 4
    return 2 * nbytes / best_copy / 1e9, nbytes / best_read / 1e9


def decode_bytes(config: DecoderConfig, params: int, batch: int, dtype_bytes: int = 4) -> tuple[int, int]:
    """Bytes a decode step must read: (weights, K/V caches). Every one of the ``params``
    parameters once — the embedding table whole only when the LM head is tied to it (else the
    lookup reads ``batch`` rows) — and each layer's full K and V caches (attention runs over the
    whole static cache)."""
    if not config.tie_embeddings:
        params -= config.vocab_size * config.dim - batch * config.dim
    kv = 2 * config.n_layers * batch * config.n_kv_heads * config.max_cache_len * config.head_dim
    return params * dtype_bytes, kv * dtype_bytes


def _child(path: str, ns: argparse.Namespace, batch: int) -> dict[str, object]:
    cmd = [sys.executable, "-m", "sextant.tools.decode_bench", "--child", path, "--config", ns.config,
           "--batch", str(batch), "--prompt", str(ns.prompt), "--steps", str(ns.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"path": path, "batch": batch, "error": f"process failed (rc {proc.returncode}): {tail}"}
    return json.loads(lines[-1])


def _first_difference(a: list[list[int]], b: list[list[int]]) -> str | None:
    for seq, (x, y) in enumerate(zip(a, b)):
        for i, (p, q) in enumerate(zip(x, y)):
            if p != q:
                return f"sequence {seq}, token {i}: {p} vs eager's {q}"
    return None


def to_markdown(rows: list[dict[str, object]], bound_ms: dict[int, float], prompt: int) -> str:
    def f(v: object, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "–"

    lines = [f"| path | batch | prefill ms ({prompt} tok) | prefill tok/s | decode ms/step | decode tok/s "
             "| × bound | compile s | peak RSS MiB | generate Δ MiB | tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["batch"]
        if "error" in r:
            lines.append(f"| {r['path']} | {b} | n/a ({r['error']}) | | | | | | {f(r.get('peak_rss_mib'), '.0f')} "
                         "| | |")
            continue
        pre, dec = r["prefill_ms"], r["decode_ms"]
        lines.append(
            f"| {r['path']} | {b} | {f(pre, '.1f')} | {f(b * prompt / pre * 1e3, '.0f')} | "  # type: ignore[operator]
            f"{f(dec, '.2f')} | {f(b / dec * 1e3 if dec else None, '.1f')} | "  # type: ignore[operator]
            f"{f(dec / bound_ms[b] if dec else None, '.2f')} | {f(r['compile_s'], '.1f')} | "  # type: ignore[index,operator]
            f"{f(r['peak_rss_mib'], '.0f')} | {f(r.get('generate_delta_mib'), '.1f')} | {r['match']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sextant.tools.decode_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="100m")
    ap.add_argument("--batch", default="1,4", help="comma-separated batch sizes")
    ap.add_argument("--prompt", type=int, default=128, help="prompt (prefill) length")
    ap.add_argument("--steps", type=int, default=128, help="greedy decode steps after the prefill")
    ap.add_argument("--paths", default=",".join(PATHS), help="of " + ",".join(PATHS))
    ap.add_argument("--quick", action="store_true", help="tiny config, prompt 8, 8 steps, batch 1,2: a smoke test")
    ap.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)  # internal: run one path, print JSON
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.config, ns.batch, ns.prompt, ns.steps = "tiny", "1,2", 8, 8
    if ns.child:
        print(json.dumps(run_path(ns.child, ns.config, int(ns.batch), ns.prompt, ns.steps)))
        return 0

    from sextant.tools.bench import _machine

    config = CONFIGS[ns.config]()
    if ns.prompt + ns.steps > config.max_cache_len:
        ap.error(f"--prompt + --steps = {ns.prompt + ns.steps} exceeds the cache ({config.max_cache_len})")
    batches = [int(b) for b in ns.batch.split(",")]
    paths = ns.paths.split(",")
    params = sum(p.numel() for p in Decoder(config).parameters())
    copy_gbs, read_gbs = copy_bandwidth()
    bound_ms, notes = {}, []
    for b in batches:
        weights, kv = decode_bytes(config, params, b)
        bound_ms[b] = (weights + kv) / (copy_gbs * 1e9) * 1e3
        notes.append(f"batch {b}: {weights / 1e6:.1f} MB of weights + {kv / 1e6:.2f} MB of K/V caches per step "
                     f"→ ≥ {bound_ms[b]:.2f} ms/step at the copy bandwidth "
                     f"(≥ {(weights + kv) / (read_gbs * 1e9) * 1e3:.2f} ms at the read bandwidth)")
    rows, failed = [], False
    for b in batches:
        eager_tokens = None
        for path in paths:
            print(f"decode bench: {path}, batch {b} ...", file=sys.stderr, flush=True)
            r = _child(path, ns, b)
            if "error" in r:
                failed |= path == "eager"
            elif path == "eager":
                eager_tokens, r["match"] = r["tokens"], "reference"
            elif eager_tokens is None:
                r["match"] = "unchecked"
            else:
                diff = _first_difference(r["tokens"], eager_tokens)  # type: ignore[arg-type]
                r["match"] = "same as eager" if diff is None else f"**MISMATCH** ({diff})"
                if diff is not None:
                    failed = True
                    print(f"decode bench: MISMATCH: {path} at batch {b} differs from eager at {diff}",
                          file=sys.stderr, flush=True)
            rows.append(r)
            print(to_markdown([r], bound_ms, ns.prompt).splitlines()[-1], file=sys.stderr, flush=True)
    print(f"Machine: {_machine()}.\n\n"
          f"Decoder `{ns.config}` ({params / 1e6:.1f}M parameters, {config.n_layers} layers × {config.dim}, "
          f"{config.n_heads} heads over {config.n_kv_heads} K/V heads, vocabulary {config.vocab_size}, static cache "
          f"{config.max_cache_len}), fp32: prefill {ns.prompt} tokens, then {ns.steps} greedy decode steps. Decode "
          f"ms/step is the median step (one token per sequence); prefill the median of 3. Memory bandwidth: "
          f"{copy_gbs:.1f} GB/s copy (read + write), {read_gbs:.1f} GB/s read (sum); "
          + "; ".join(notes) + ". × bound: decode ms/step over the copy-bandwidth bound. Peak RSS: the path's "
          "process over its whole run (model, compile, generation); generate Δ: its resident set's peak during "
          "the timed generation above the level at its start (memory reused from the warm-up calls not counted). "
          "Timings are of a machine shared with whatever else runs: check its load.\n")
    print(to_markdown(rows, bound_ms, ns.prompt))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
