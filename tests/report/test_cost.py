"""The cost model on cases small enough to count by hand."""

import pytest
import torch
from torch import nn

from sextant.frontend.capture import capture
from sextant.graph.dtypes import DType
from sextant.graph.ir import Node
from sextant.graph.ops import TensorType
from sextant.graph.passes import run_pipeline
from sextant.report.cost import node_flops, program_costs
from sextant.schedule.program import Program, schedule
from sextant.schedule.target import sm90_target


def _program(module: nn.Module, *args: torch.Tensor) -> Program:
    return schedule(run_pipeline(capture(module.eval(), args), "default"), sm90_target())


def test_linear_layer() -> None:
    (c,) = program_costs(_program(nn.Linear(32, 16), torch.randn(8, 32)))
    assert c.kind == "matmul" and c.dtype == DType.f32
    assert c.flops_by_op == {"matmul": 2 * 8 * 32 * 16, "add": 8 * 16}  # x @ W^T, + bias
    assert c.flops == 2 * 8 * 32 * 16 + 8 * 16 and c.transcendentals == 0
    assert c.bytes_read == 4 * (8 * 32 + 32 * 16 + 16)  # x, W, bias: each once
    assert c.bytes_written == 4 * 8 * 16
    assert c.intensity == pytest.approx(c.flops / (c.bytes_read + c.bytes_written))


class Softmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


def test_softmax() -> None:
    (c,) = program_costs(_program(Softmax(), torch.randn(4, 10)))
    # max: 9 combines per row; x - max, exp, / sum: 40 each; sum: 9 per row
    assert c.flops_by_op == {"reduce": 2 * 4 * 9, "sub": 40, "exp": 40, "div": 40}
    assert c.transcendentals == 40
    assert (c.bytes_read, c.bytes_written) == (4 * 40, 4 * 40)


def test_embedding_reads_only_the_rows_it_gathers() -> None:
    (c,) = program_costs(_program(nn.Embedding(1000, 16), torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]])))
    assert c.flops == 0
    assert c.bytes_read == 10 * 16 * 4 + 10 * 8  # 10 rows of f32[16], not the f32[1000,16] table; i64 ids
    assert c.bytes_written == 10 * 16 * 4


def test_conv_layer() -> None:
    costs = program_costs(_program(nn.Conv2d(3, 8, 3), torch.randn(1, 3, 10, 10)))
    assert sum(c.flops_by_op.get("conv", 0) for c in costs) == 2 * (8 * 8 * 8) * (3 * 3 * 3)
    assert sum(c.flops_by_op.get("add", 0) for c in costs) == 8 * 8 * 8  # bias


def test_unknown_op_is_named() -> None:
    with pytest.raises(ValueError, match="no FLOP rule for op 'bogus'"):
        node_flops(Node("bogus", (), (), TensorType((4,), DType.f32)))
