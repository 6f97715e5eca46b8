"""The report page, checked as text: well-formed, self-contained, every kernel there, and a
LayerNorm traceable from its source line to its PTX."""

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import sextant
from sextant.codegen.llvm_nvptx import ptx_entries
from sextant.codegen.sass import find_disassembler
from sextant.examples import mlp
from sextant.report.html import render_report
from sextant.report.listings import llvm_functions
from sextant.report.sources import source_line
from sextant.runtime.compiled import CompiledModule

VOID = {"meta", "br", "hr", "img", "input", "link", "wbr", "col", "area", "base", "source", "track"}


class _Checker(HTMLParser):
    """Every element closed in order, no raw ``<`` in text, ids unique, internal links resolvable."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=False)  # so that a raw '<' in text shows
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.ids: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if "id" in a:
            self.ids.append(a["id"] or "")
        if (a.get("href") or "").startswith("#"):
            self.links.append(a["href"][1:])
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes <{self.stack[-1] if self.stack else None}> at {self.getpos()}")
        else:
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        if "<" in data and self.stack[-1:] not in (["script"], ["style"]):
            self.problems.append(f"raw '<' in text at {self.getpos()}: {data[:60]!r}")


@pytest.fixture(scope="module")
def page(gpt2_report: Path) -> str:
    return gpt2_report.read_text()


@pytest.fixture(scope="module")
def checked(page: str) -> _Checker:
    c = _Checker()
    c.feed(page)
    c.close()
    return c


def test_well_formed_and_self_contained(page: str, checked: _Checker) -> None:
    assert checked.problems == [] and checked.stack == []
    assert len(checked.ids) == len(set(checked.ids)), "duplicate ids"
    assert set(checked.links) <= set(checked.ids), f"dangling links: {set(checked.links) - set(checked.ids)}"
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//|<link\b|@import|url\(\s*["']?https?:""", page), \
        "the page must not load anything from the network"


def _kernel_html(page: str, name: str) -> str:
    """The page's section for kernel ``name``."""
    section = page[page.index(f'<div class="kernel" id="kernel-{name}"'):]
    end = section.find('<div class="kernel"', 1)
    return section[:end] if end > 0 else section[: section.index("</section>")]


def test_every_kernel_and_launch_is_there(gpt2_compiled: CompiledModule, page: str, checked: _Checker) -> None:
    program = gpt2_compiled.stages["program"]
    ids = set(checked.ids)
    assert {f"kernel-{k}" for k in program.kernels} <= ids
    assert {f"launch-{i}" for i in range(len(program.launches))} <= ids
    for name, res in gpt2_compiled.stages["ptxas"].kernels.items():  # each kernel's ptxas figures and PTX
        section = _kernel_html(page, name)
        assert f".visible .entry {name}(" in section
        assert f"<tr><td></td><td class=num>{res.registers}</td><td class=num>{res.shared_bytes} B</td>" in section
        for li, launch in enumerate(program.launches):
            assert (f'id="launch-{li}"' in section) == (launch.kernel == name)


def test_layernorm_from_source_line_to_ptx(gpt2_compiled: CompiledModule, page: str) -> None:
    program = gpt2_compiled.stages["program"]
    ln = next(li for li, launch in enumerate(program.launches)
              if any(m.loc == "modeling_gpt2.py:276" for m in program.groups[launch.group].members))
    name = program.launches[ln].kernel
    kernel = _kernel_html(page, name)
    launch = kernel[kernel.index(f'id="launch-{ln}"'):]
    assert "modeling_gpt2.py:276" in launch and "hidden_states = self.ln_1(hidden_states)" in launch
    assert "reduce sum div sub mul reduce sum div add rsqrt mul mul add" in launch  # the LayerNorm's ops
    assert f".visible .entry {name}(" in kernel and "shfl.sync.bfly" in kernel  # its PTX, warp reductions
    assert f'href="#launch-{ln}"' in page[page.index('id="graph"'):]  # the graph box links to it


def test_escaping_and_estimates(page: str) -> None:
    assert "; q3 &lt; 128; q3 += 32)" in page  # kernel IR loops, escaped
    assert "predicted time on H100 SXM5 80GB" in page and "Roofline (H100 SXM5 80GB)" in page
    for gpu in ("A100", "H100", "H200"):
        assert f"{gpu} (" in page


@pytest.mark.skipif(find_disassembler() is None, reason="no nvdisasm/cuobjdump (pip install nvidia-cuda-nvdisasm)")
def test_sass_listed(gpt2_compiled: CompiledModule, page: str) -> None:
    for name in gpt2_compiled.stages["program"].kernels:
        assert re.search(rf"<summary>SASS \(\d+ lines\)</summary><pre>//-+\s*\.text\.{name}\b", page), name


def test_cpu_target_report_has_no_gpu_listings() -> None:
    model, args = mlp()
    page = render_report(sextant.compile(model, args, target="cpu"), gpu="A100")
    c = _Checker()
    c.feed(page)
    assert c.problems == [] and "this target does not emit PTX" in page and "ptxas sm_" not in page
    assert "LLVM IR, after O3" in page and "define" in page


def test_reference_target_is_refused() -> None:
    compiled = sextant.compile(torch.nn.ReLU(), (torch.randn(4),), target="reference")
    with pytest.raises(ValueError, match="no kernels to report: target 'reference'"):
        render_report(compiled)


def test_listings_split_per_kernel() -> None:
    ir = ('define ptx_kernel void @"k_0"(ptr %a) {\nentry:\n  ret void\n}\n'
          "define internal float @helper(float %x) {\n  ret float %x\n}\n")
    assert list(llvm_functions(ir)) == ["k_0", "helper"] and llvm_functions(ir)["k_0"].endswith("ret void\n}")
    ptx = (".visible .entry a(\n\t.param .u64 p\n)\n{\n\t{ // inner\n\t}\n\tret;\n}\n"
           "// between\n.visible .entry b()\n{\n\tret;\n}\n")
    entries = ptx_entries(ptx)
    assert list(entries) == ["a", "b"] and entries["a"].endswith("ret;\n}") and "between" not in entries["a"]


def test_checker_catches_what_it_checks() -> None:
    c = _Checker()
    c.feed("<div><pre>for (i = 0; i < n; i++)</pre><span></div>")
    c.close()
    assert any("raw '<'" in p for p in c.problems) and any("</div> closes <span>" in p for p in c.problems)


def test_source_lines_resolve() -> None:
    here = source_line(f"{Path(__file__).name}:1")
    assert here.code == '"""The report page, checked as text: well-formed, self-contained, every kernel there, and a'
    assert source_line("no_such_file_anywhere.py:3").code == "" and source_line("garbage").code == ""


def test_cuda_sim_counters_sit_next_to_ptxas() -> None:
    """Given cuda-sim's counters, each kernel shows its bank conflicts, coalescing and MMA count;
    fused f16 attention is one tensor-core kernel there."""
    from sextant.runtime.counting import count_program

    class Attention(torch.nn.Module):
        def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    q = torch.randn(1, 2, 64, 32).half()
    cm = sextant.compile(Attention(), (q, q, q), target="cuda-sim", cache=False)
    counted = count_program(cm.stages["program"], (q, q, q))
    page = render_report(cm, "H200", counters=counted)
    (name,) = counted
    section = page[page.index(f'id="kernel-{name}"'):]
    assert "cuda-sim counters" in section and "bank conflicts" in section
    row = re.search(r"<tr><td></td>(.*?)</tr>", section[section.index("cuda-sim counters"):]).group(1)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert cells[1] == "0"  # no bank conflicts
    assert int(cells[4].replace(",", "")) == counted[name].mma_instructions > 0
    assert "cuda-sim counters" not in render_report(cm, "H200")  # only when counted
