"""Running a program's extern calls (``Launch.extern``): the op on the launch's buffers, its results
copied into the buffers the schedule planned for them. Shared by every runner."""

from __future__ import annotations

from typing import Any

import torch

from sextant.errors import SextantError
from sextant.graph.extern import call_extern
from sextant.runtime.collectives import run_collective
from sextant.schedule.program import CollectiveCall, Launch, Program


class ExternCallError(SextantError, RuntimeError):
    """An extern op failed, or returned results unlike those torch.export recorded for it."""


def run_extern(program: Program, launch: Launch, tensors: dict[int, torch.Tensor],
               device: torch.device | None = None, pending: dict[int, Any] | None = None) -> None:
    """Call ``launch``'s op on ``tensors`` (buffer index → tensor of the buffer's shape) and write
    its results into the output buffers; or, for a collective, start it or wait for it (``pending``:
    the call's transfers in flight, one dict per call of the program)."""
    call = launch.extern
    assert call is not None
    if isinstance(call, CollectiveCall):
        if pending is None:
            raise AssertionError("a collective launched without the call's table of transfers in flight")
        run_collective(call, launch.args, tensors, pending)
        return
    ins, outs = call.split(launch.args)
    operands = [tensors[b] for b in ins]
    where = f"{call.fn} (extern call from {call.loc or 'an unknown line'})"
    try:
        results = call_extern(call.fn, call.args, call.kwargs, operands, device)
    except Exception as e:  # the op's own error, with the call it came from
        raise ExternCallError(f"{where} failed: {type(e).__name__}: {e}") from e
    for r, b in zip(call.results, outs):
        out = tensors[b]
        if r >= len(results):
            raise ExternCallError(f"{where} returned {len(results)} tensors; result {r} was expected")
        got = results[r]
        if tuple(got.shape) != tuple(out.shape) or got.dtype != out.dtype:
            raise ExternCallError(f"{where}: result {r} is {got.dtype}{list(got.shape)}, but torch.export "
                                  f"recorded {out.dtype}{list(out.shape)} (buffer {b})")
        out.copy_(got)
