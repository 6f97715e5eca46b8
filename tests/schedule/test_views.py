"""``schedule/views.py``: re-indexing chains as strided views, checked against torch's own views."""

from __future__ import annotations

import random

import torch

from sextant.graph.builder import GraphBuilder
from sextant.graph.dtypes import DType
from sextant.schedule.views import strided_view


def _random_chain(rng: random.Random) -> tuple[list[tuple], tuple[int, ...]]:
    shape = tuple(rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 4)))
    ops: list[tuple] = []
    cur = shape
    for _ in range(rng.randint(1, 5)):
        kind = rng.choice(["permute", "reshape", "slice", "expand"])
        if kind == "permute":
            perm = list(range(len(cur)))
            rng.shuffle(perm)
            ops.append(("permute", tuple(perm)))
            cur = tuple(cur[p] for p in perm)
        elif kind == "reshape":
            numel = 1
            for d in cur:
                numel *= d
            dims = [numel]
            if numel % 2 == 0 and rng.random() < 0.5:
                dims = [2, numel // 2]
            if rng.random() < 0.3:
                dims = [*dims, 1]
            ops.append(("reshape", tuple(dims)))
            cur = tuple(dims)
        elif kind == "slice":
            dim = rng.randrange(len(cur))
            if cur[dim] < 2:
                continue
            start, step = rng.randrange(cur[dim] // 2), rng.choice([1, 2])
            size = (cur[dim] - start + step - 1) // step
            ops.append(("slice", dim, start, size, step))
            cur = cur[:dim] + (size,) + cur[dim + 1:]
        else:
            ones = [i for i, d in enumerate(cur) if d == 1]
            if not ones:
                continue
            new = list(cur)
            new[ones[0]] = 3
            ops.append(("expand", tuple(new)))
            cur = tuple(new)
    return ops, shape


def test_strided_views_agree_with_torch() -> None:
    rng = random.Random(0)
    checked = refused = 0
    for _ in range(400):
        ops, shape = _random_chain(rng)
        b = GraphBuilder()
        x = b.input("x", shape, DType.f32)
        t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
        node, view, viewable = x, t, True
        for op in ops:
            if op[0] == "permute":
                node, view = b.permute(node, op[1]), view.permute(op[1])
            elif op[0] == "reshape":
                node = b.reshape(node, op[1])
                try:
                    view = view.view(op[1])
                except RuntimeError:  # torch would need a copy: no strided view exists
                    viewable, view = False, view.reshape(op[1])
            elif op[0] == "slice":
                _, dim, start, size, step = op
                node = b.slice(node, dim, start, size, step)
                view = view.narrow(dim, start, (size - 1) * step + 1)[(slice(None),) * dim + (slice(None, None, step),)]
            else:
                node, view = b.expand(node, op[1]), view.expand(op[1])
        got = strided_view(node, {id(x): "in0"})
        if got is None:
            assert not viewable, ops
            refused += 1
            continue
        checked += 1
        flat = t.reshape(-1)
        rebuilt = flat.as_strided(node.shape, got.strides, got.offset) if node.shape else flat[got.offset]
        torch.testing.assert_close(rebuilt, view.reshape(node.shape), rtol=0, atol=0)
    assert checked > 300 and refused > 0, (checked, refused)


def test_casts_are_views_only_when_exact() -> None:
    b = GraphBuilder()
    x = b.input("x", (4, 8), DType.f16)
    up = b.permute(b.cast(x, DType.f32), (1, 0))
    view = strided_view(up, {id(x): "in0"}, exact_from=DType.f16)
    assert view is not None and view.strides == (1, 8)
    assert strided_view(up, {id(x): "in0"}) is None  # a cast is arithmetic unless declared exact
