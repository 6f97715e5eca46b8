"""Kernel IR ⇄ JSON round trip over every kernel the example models schedule into (CPU and GPU)."""

import json
import math

import pytest

from sextant.examples import EXAMPLES
from sextant.frontend.capture import capture
from sextant.graph.dtypes import DType
from sextant.graph.passes import run_pipeline
from sextant.kernel import ir
from sextant.kernel.printer import print_kernel
from sextant.kernel.serialize import (
    KernelSerializeError,
    kernel_from_json,
    kernel_to_json,
    kernels_from_json,
    kernels_to_json,
)
from sextant.schedule.program import schedule
from sextant.schedule.target import cpu_target, sm90_target

_GRAPHS: dict = {}


def _graph(name: str):
    if name not in _GRAPHS:
        model, args = EXAMPLES[name]()
        _GRAPHS[name] = run_pipeline(capture(model, args), "default")
    return _GRAPHS[name]


@pytest.mark.parametrize("target", [cpu_target, sm90_target], ids=["cpu", "sm_90"])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_round_trip_example_kernels(name: str, target) -> None:
    kernels = list(schedule(_graph(name), target()).kernels.values())
    assert kernels
    text = json.dumps(kernels_to_json(kernels), allow_nan=False)  # strict JSON: no NaN/Infinity literals
    back = kernels_from_json(json.loads(text))
    assert back == kernels
    for a, b in zip(kernels, back):
        assert a.meta == b.meta  # meta is not part of Kernel equality; check it separately
        assert print_kernel(a) == print_kernel(b)


def test_special_floats_and_types_survive() -> None:
    x = ir.Var("x", DType.f32)
    body = (
        ir.Assign(x, ir.Const(-math.inf, DType.f32)),
        ir.Assign(x, ir.Binary("maximum", x, ir.Const(-0.0, DType.f32), DType.f32)),
        ir.If(ir.Binary("ne", x, ir.Const(math.nan, DType.f32), DType.bool),
              (ir.Store("out", ir.c(0), ir.Cast(x, DType.f16)),)),
        ir.Store("flag", ir.c(0), ir.Const(True, DType.bool)),
        ir.Barrier(),
    )
    k = ir.Kernel("k", (ir.Buffer("out", DType.f16, 1, role="out"), ir.Buffer("flag", DType.bool, 1, role="out")),
                  (1, 1, 1), (32, 1, 1), body, meta={"tile": (4, 8), "mapping": "x"})
    back = kernel_from_json(json.loads(json.dumps(kernel_to_json(k), allow_nan=False)))
    assert back.body[0].value.value == -math.inf
    zero = back.body[1].value.b.value
    assert zero == 0.0 and math.copysign(1.0, zero) == -1.0
    assert math.isnan(back.body[2].cond.b.value)
    assert back.body[3].value.value is True and back.body[3].value.dtype is DType.bool
    assert back.body[2].then[0].value.dtype is DType.f16
    assert back.meta == {"tile": (4, 8), "mapping": "x"}
    # Const(True) must not come back as Const(1): the value's Python type is part of the IR
    assert type(back.body[3].value.value) is bool and type(back.body[0].value.value) is float


def test_rejects_unknown_nodes_fields_and_versions() -> None:
    k = ir.Kernel("k", (), (1, 1, 1), (1, 1, 1), (ir.Barrier(),))
    doc = kernels_to_json([k])
    bad = json.loads(json.dumps(doc))
    bad["kernels"][0]["body"][0]["_"] = "Teleport"
    with pytest.raises(KernelSerializeError, match="unknown kernel IR node 'Teleport'"):
        kernels_from_json(bad)
    bad = json.loads(json.dumps(doc))
    bad["kernels"][0]["colour"] = "red"
    with pytest.raises(KernelSerializeError, match=r"Kernel has no field\(s\) \['colour'\]"):
        kernels_from_json(bad)
    with pytest.raises(KernelSerializeError, match="version 99 is not supported"):
        kernels_from_json({**doc, "version": 99})
    with pytest.raises(KernelSerializeError, match="not a kernel IR document"):
        kernels_from_json({"kernels": []})
    with pytest.raises(KernelSerializeError, match="cannot serialize a object"):
        kernel_to_json(ir.Kernel("k", (), (1, 1, 1), (1, 1, 1), (), meta={"node": object()}))
    bad = json.loads(json.dumps(doc))
    bad["kernels"][0]["params"] = [{"_": "Buffer", "name": "a", "dtype": "f64", "size": 1}]
    with pytest.raises(KernelSerializeError, match="unknown dtype 'f64'"):
        kernels_from_json(bad)
