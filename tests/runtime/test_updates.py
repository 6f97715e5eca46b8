"""Modules that update tensors in forward(): KV caches as buffers, arguments updated in place.

Every case runs the compiled module and eager side by side on fresh random inputs over several
steps and compares both the outputs and the updated tensors; the in-place cases also check that
the program writes the new rows straight into the module's buffer (no full write-back) and that
the only launches writing the buffer are scatters over one step's rows.
"""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import sextant
from sextant.decoder import Decoder, DecoderConfig, greedy_generate
from sextant.errors import ExportError, InputError, UnsupportedOpError
from sextant.graph.parser import parse_graph
from sextant.graph.printer import print_graph

TARGETS = ["reference", "cpu", "cuda-sim"]


class Cache(torch.nn.Module):
    """A two-buffer cache written at the given positions (index_put and index_copy_), read whole."""

    def __init__(self, heads: int = 2, slots: int = 8, dim: int = 4) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(1, heads, slots, dim))
        self.register_buffer("v", torch.zeros(1, heads, slots, dim))

    def forward(self, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.k[:, :, pos] = k
        self.v.index_copy_(2, pos, k * 2)
        return self.k.sum(-1) + self.v.amax(-1)


def _pair(cls: type[torch.nn.Module], *a) -> tuple[torch.nn.Module, torch.nn.Module]:
    m, e = cls(*a), cls(*a)
    e.load_state_dict(m.state_dict())
    return m, e


def _steps(compiled, module, eager, positions: list[list[int]], shape=(1, 2, -1, 4)) -> None:
    for pos in positions:
        k = torch.randn(*[len(pos) if s == -1 else s for s in shape])
        p = torch.tensor(pos)
        torch.testing.assert_close(compiled(k, p), eager(k, p))
        for name, buf in eager.named_buffers():
            torch.testing.assert_close(module.get_buffer(name), buf, msg=f"buffer {name}")


@pytest.mark.parametrize("target", TARGETS)
def test_buffers_updated_in_place(target):
    m, e = _pair(Cache)
    compiled = sextant.compile(m, (torch.randn(1, 2, 3, 4), torch.arange(3)), target=target, cache=False)
    assert [(u.target, u.kind) for u in compiled.graph.mutations] == [("k", "buffer"), ("v", "buffer")]
    _steps(compiled, m, e, [[0, 1, 2], [3, 4, 5], [7, 6, 5]])
    if target != "reference":
        assert compiled.full_write_backs == 0  # the program wrote the rows into the buffers themselves
        program = compiled.stages["program"]
        for update in compiled.graph.mutations:  # the buffer is written only by scatters of the step's rows
            buf = update.input
            writers = [la for la in program.launches if buf in la.args and program.kernels[la.kernel].params[
                la.args.index(buf)].role != "in"]
            assert writers and all(program.groups[la.group].kind == "scatter" for la in writers)
            for la in writers:
                src = program.groups[la.group].anchor.inputs[2]
                assert src.type.nbytes == 3 * 2 * 4 * 4  # 3 positions x 2 heads x 4 floats: not the 8 slots
        assert "in place: 3 of 8 positions along dim 2 of input %k" in program.describe()


class NegativePositions(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.zeros(3, 8))

    def forward(self, row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.c[:, pos] = row  # index_put counts negative positions from the end
        return self.c.sum(0)


def test_negative_positions_count_from_the_end():
    m, e = _pair(NegativePositions)
    compiled = sextant.compile(m, (torch.randn(3, 2), torch.tensor([0, 1])), target="cpu", cache=False)
    for pos in ([-1, 2], [-8, -7]):
        row = torch.randn(3, 2)
        torch.testing.assert_close(compiled(row, torch.tensor(pos)), e(row, torch.tensor(pos)))
        torch.testing.assert_close(m.c, e.c)
    with pytest.raises(InputError, match=r"position -9 .* \(allowed: -8\.\.7\)"):
        compiled(torch.randn(3, 2), torch.tensor([-9, 0]))


def test_update_text_round_trips():
    g = sextant.compile(Cache(), (torch.randn(1, 2, 3, 4), torch.arange(3)), target="reference", cache=False).graph
    text = print_graph(g)
    assert 'update %k_1 <- ' in text and '{buffer="k"}' in text  # the argument k is %k
    assert print_graph(parse_graph(text, g.params)) == text


class ReadsOldValue(torch.nn.Module):
    """Reads the cache before and after the update: the old value must survive the write."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.randn(1, 2, 8, 4))

    def forward(self, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        old = self.c * 1.0
        self.c[:, :, pos] = k
        return old.sum(-1) - self.c.sum(-1)


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_update_copies_when_the_old_value_is_read(target):
    m, e = _pair(ReadsOldValue)
    compiled = sextant.compile(m, (torch.randn(1, 2, 1, 4), torch.tensor([0])), target=target, cache=False)
    _steps(compiled, m, e, [[0], [5], [2]])
    dump = compiled.stages["program"].describe()
    assert "copies the whole tensor first: 2 ops read the value it updates" in dump
    assert compiled.full_write_backs == 3  # said, and done: the new value is stored back by a copy


class ReturnsCache(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("c", torch.zeros(2, 8))

    def forward(self, row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.c.index_copy_(1, pos, row)
        return self.c


def test_module_returning_its_updated_buffer():
    m, e = _pair(ReturnsCache)
    compiled = sextant.compile(m, (torch.randn(2, 1), torch.tensor([0])), target="cpu", cache=False)
    for p in range(3):
        row = torch.randn(2, 1)
        out = compiled(row, torch.tensor([p]))
        torch.testing.assert_close(out, e(row, torch.tensor([p])))
        torch.testing.assert_close(m.c, e.c)
    out.zero_()  # the returned value is the module's to keep, not a view the next call overwrites
    assert m.c.abs().sum() > 0


class UpdatesArgument(torch.nn.Module):
    def forward(self, cache: torch.Tensor, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(1, pos, k)
        return cache.sum(0)


@pytest.mark.parametrize("target", ["cpu", "cuda-sim"])
def test_argument_updated_in_place(target):
    cache = torch.zeros(3, 16)
    compiled = sextant.compile(UpdatesArgument(), (cache.clone(), torch.randn(3, 2), torch.tensor([0, 1])),
                               target=target, cache=False)
    assert [(u.target, u.kind) for u in compiled.graph.mutations] == [("cache", "input")]
    ref = cache.clone()
    for start in (0, 4, 14):
        k, pos = torch.randn(3, 2), torch.tensor([start, start + 1])
        out = compiled(cache, k, pos)
        torch.testing.assert_close(out, UpdatesArgument()(ref, k, pos))
        torch.testing.assert_close(cache, ref)
    assert compiled.full_write_backs == 0


def test_position_past_the_cache_is_refused():
    m = Cache()
    compiled = sextant.compile(m, (torch.randn(1, 2, 1, 4), torch.tensor([0])), target="cpu", cache=False)
    before = m.k.clone()
    with pytest.raises(InputError, match=r"argument 'pos': position 8 is outside 'k', which has 8 positions"):
        compiled(torch.randn(1, 2, 1, 4), torch.tensor([8]))
    with pytest.raises(InputError, match=r"position -9 .* \(allowed: -8\.\.7\)"):
        compiled(torch.randn(1, 2, 1, 4), torch.tensor([-9]))
    assert torch.equal(m.k, before)  # nothing ran


class AliasedBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 8))
        self.register_buffer("shadow", self.w.data)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        self.shadow.index_copy_(1, pos, x)
        return x.sum()


def test_buffer_sharing_a_parameter_is_refused_with_its_name():
    with pytest.raises((UnsupportedOpError, ExportError), match=r"'shadow' shares its storage with .*'w'"):
        sextant.compile(AliasedBuffer(), (torch.randn(4, 1), torch.tensor([0])), target="cpu", cache=False)


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda-sim", marks=pytest.mark.slow)])  # cuda-sim ~38 s
def test_gpt_fast_style_decoder_matches_eager_token_for_token(target):
    """Prefill and decode are two static programs sharing the module's caches; every decode step
    runs the same program at a new position (an input, not a recompile)."""
    cfg = DecoderConfig.tiny()
    m, e = Decoder(cfg, batch=2), Decoder(cfg, batch=2)
    e.load_state_dict(m.state_dict())
    prompt = torch.randint(0, cfg.vocab_size, (2, 6))
    prefill = sextant.compile(m, (prompt, torch.arange(6)), target=target, cache=False)
    decode = sextant.compile(m, (prompt[:, :1], torch.tensor([6])), target=target, cache=False)

    def step(ids, pos):
        return (prefill if ids.shape[1] > 1 else decode)(ids, pos)

    assert torch.equal(greedy_generate(step, prompt, 12), greedy_generate(e, prompt, 12))
    for c_m, c_e in zip(m.caches(), e.caches()):
        torch.testing.assert_close(c_m.k_cache, c_e.k_cache, rtol=1e-4, atol=1e-5)
    assert prefill.full_write_backs == decode.full_write_backs == 0
    if target == "cpu":  # the attention skips key tiles past the position (the mask row hides them)
        kernels = decode.stages["program"].kernels.values()
        assert any(k.meta.get("skips_hidden_tiles") for k in kernels if k.meta.get("mapping") == "attention-cpu-flash")
    dump = decode.stages["program"].describe()
    assert dump.count(f"in place: 1 of {cfg.max_cache_len} positions along dim 2") == 2 * cfg.n_layers


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda-sim", marks=pytest.mark.slow)])  # cuda-sim ~28 s
def test_decoder_with_symbolic_sequence_is_one_program(target):
    cfg = DecoderConfig.tiny()
    m, e = Decoder(cfg), Decoder(cfg)
    e.load_state_dict(m.state_dict())
    prompt = torch.randint(0, cfg.vocab_size, (1, 5))
    seq = Dim("seq", min=1, max=cfg.max_cache_len)
    compiled = sextant.compile(m, (prompt, torch.arange(5)), target=target, cache=False,
                               dynamic_shapes={"idx": {1: seq}, "input_pos": {0: seq}})
    assert compiled.stages.get("per_binding") is None  # one program for the prompt and every step
    assert torch.equal(greedy_generate(compiled, prompt, 8), greedy_generate(e, prompt, 8))
    assert compiled.full_write_backs == 0


def test_cost_report_counts_only_the_rows_written():
    from sextant.report import program_costs

    compiled = sextant.compile(Cache(), (torch.randn(1, 2, 1, 4), torch.tensor([0])), target="cpu", cache=False)
    costs = [c for c in program_costs(compiled.stages["program"]) if c.kind == "scatter"]
    assert len(costs) == 2 and all(c.bytes_written == 2 * 4 * 4 for c in costs)  # one position of 2 heads x 4
