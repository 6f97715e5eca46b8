"""The ``sextant`` command: compile, run or explain a model from the terminal.

    sextant compile MODEL [--target T] [--arch sm_90] [-o DIR] [--dump STAGES] [--report FILE.html]
    sextant run MODEL [--target T] [--runs N] [--atol A] [--rtol R]
    sextant explain MODEL [--target T] [--gpu H100]

MODEL is a built-in example or FILE.py:FACTORY (a function returning ``(module, example_args)``).
Errors print as one message plus a hint; ``--verbose`` adds the traceback. Exit codes: see
:mod:`sextant.cli.errors`.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from sextant.cli.errors import EXIT_CODES_HELP, CliError, ExitCode

if TYPE_CHECKING:
    from sextant.cli.build import Build

DESCRIPTION = "Compile a PyTorch model with sextant, run it against eager PyTorch, or explain what the compiler did."
MODEL_HELP = ("a built-in example (mlp, cnn, transformer-block, gpt2), FILE.py:FACTORY, where FACTORY() returns "
              "(module, example_args) or (module, example_args, example_kwargs), or an ONNX file FILE.onnx")
STAGES_HELP = ("comma-separated stages to write: graph, passes (graph IR after every pass), schedule, kernel, llvm, "
               "ptx, sass (needs nvdisasm or cuobjdump), or all")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting, so usage errors go through the same reporting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(message, f"see `{self.prog} --help`", ExitCode.USAGE)


def make_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    common.add_argument("--target", default="cuda-sim", choices=("cpu", "cuda", "cuda-sim"),
                        help="cuda-sim (default): GPU code, run on the CPU; cuda: a real GPU; cpu: x86 code")
    common.add_argument("--arch", help="GPU architecture, e.g. sm_80 (default: sm_90 for cuda-sim, the GPU's own "
                        "for cuda)")
    common.add_argument("--pipeline", default="default",
                        help="graph pass pipeline: a name (default) or comma-separated pass names")
    common.add_argument("--input-shape", metavar="NAME=D0,D1,...", action="append",
                        help="static shape of an ONNX input with symbolic dimensions (repeatable)")
    common.add_argument("--report", metavar="FILE.html", type=Path, help="also write an HTML report of the compilation")
    common.add_argument("--gpu", default="H100", help="GPU model for roofline estimates (explain, --report)")
    common.add_argument("--strict", action="store_true",
                        help="refuse ops with no lowering instead of running them as extern calls")
    common.add_argument("-v", "--verbose", action="store_true",
                        help="show tracebacks and warnings, and what the compile produced (nodes, kernels, statements)")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")

    parser = _Parser(prog="sextant", description=DESCRIPTION, epilog=EXIT_CODES_HELP,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    fmt = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("compile", parents=[common], help="compile MODEL; optionally dump every stage to files",
                       description="Compile MODEL and optionally write the chosen stages to DIR, with an index.md.",
                       epilog=EXIT_CODES_HELP, formatter_class=fmt)
    p.add_argument("-o", "--output", metavar="DIR", type=Path,
                   help="folder for the dump (default sextant-dump/MODEL); -o without --dump writes all stages")
    p.add_argument("--dump", metavar="STAGES", help=STAGES_HELP)
    p = sub.add_parser("run", parents=[common], help="compile MODEL, run it, compare with eager PyTorch, time both",
                       description="Compile MODEL, run it and eager PyTorch on the same fresh random inputs, print "
                                   "the max error and timings; exit 3 if the error exceeds the tolerance.",
                       epilog=EXIT_CODES_HELP, formatter_class=fmt)
    p.add_argument("--runs", type=int, default=20, help="timed calls per side (median reported; default 20)")
    p.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance (default 1e-4)")
    p.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p = sub.add_parser("explain", parents=[common], help="summarise ops, passes, kernels, registers and costs",
                       description="Compile MODEL and summarise what happened: ops captured, what each pass changed, "
                                   "kernels with their fused ops, launch shapes, registers/spills, FLOPs and bytes.",
                       epilog=EXIT_CODES_HELP, formatter_class=fmt)
    p.add_argument("--counters", action="store_true",
                   help="with --target cuda-sim: run the model once through a counting build and show each kernel's "
                        "shared-memory bank conflicts, global coalescing and tensor-core instructions")
    return parser


def _model_dirname(spec: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in spec.rsplit("/", 1)[-1]) or "model"


def _cmd_compile(ns: argparse.Namespace, build: Build, out: TextIO) -> int:
    from sextant.cli.dump import parse_stages, write_dump

    c = build.compiled
    program = c.stages.get("program")
    kernels = f", {len(program.kernels)} kernels in {len(program.launches)} launches" if program else ""
    target = c.target + (f" {build.arch}" if build.is_gpu else "")
    print(f"compiled {build.model.name} for {target}: {len(c.graph.nodes)} graph nodes{kernels} "
          f"in {build.seconds:.2f} s", file=out)
    for n in build.notes:
        print(f"note: {n}", file=out)
    if ns.dump is None and ns.output is None:
        return ExitCode.OK
    stages = parse_stages(ns.dump or "all")
    folder = ns.output or Path("sextant-dump") / _model_dirname(build.model.name)
    command = "sextant " + " ".join(shlex.quote(a) for a in ns.argv)
    entries, notes = write_dump(build, folder, stages, command)
    for n in notes:
        print(f"note: {n}", file=out)
    print(f"wrote {len(entries)} files to {folder} (index: {folder / 'index.md'})", file=out)
    return ExitCode.OK


def _cmd_run(ns: argparse.Namespace, build: Build, out: TextIO) -> int:
    from sextant.cli.run import run_and_compare

    result = run_and_compare(build, runs=ns.runs, atol=ns.atol, rtol=ns.rtol, seed=ns.seed, out=out)
    if not result.ok:
        raise CliError(f"the compiled model's outputs differ from {build.model.eager_name}: max abs error "
                       f"{result.max_abs:.3g}, "
                       f"max relative {result.max_rel:.3g} (atol={ns.atol:g}, rtol={ns.rtol:g})",
                       "loosen --atol/--rtol if this is rounding; otherwise it is a sextant bug: report it with MODEL",
                       ExitCode.MISMATCH)
    return ExitCode.OK


def _cmd_explain(ns: argparse.Namespace, build: Build, out: TextIO) -> int:
    from sextant.cli.explain import explain

    explain(build, out, gpu=ns.gpu, counters=ns.counters)
    return ExitCode.OK


def _write_report(build: Build, path: Path, gpu: str, out: TextIO) -> None:
    try:
        from sextant.report.html import write_report
    except ImportError as e:
        raise CliError(f"--report: the HTML report generator is not available ({e})",
                       "update sextant (sextant.report.write_report), or drop --report", ExitCode.ENVIRONMENT) from e
    counters = None
    if build.target == "cuda-sim":  # one counted run on the example inputs: the report shows them per kernel
        from sextant.cli.explain import _counters

        counters, _ = _counters(build)
    write_report(build.compiled, path, gpu=gpu, counters=counters)
    print(f"wrote report {path}", file=out)


COMMANDS = {"compile": _cmd_compile, "run": _cmd_run, "explain": _cmd_explain}


@contextlib.contextmanager
def _quiet_warnings(verbose: bool) -> Iterator[None]:
    """torch.export and transformers warn about things the user cannot act on; --verbose shows them."""
    with warnings.catch_warnings():
        if not verbose:
            warnings.simplefilter("ignore")
        yield


def _check_gpu_name(name: str) -> None:
    try:
        from sextant.report.roofline import GPUS, gpu_spec
    except ImportError:  # explain then shows no roofline times, and --report says what is missing
        return
    try:
        gpu_spec(name)
    except ValueError as e:
        raise CliError(f"--gpu: unknown GPU {name!r}", f"known: {', '.join(GPUS)}", ExitCode.USAGE) from e


def _execute(ns: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from sextant.cli.build import build, parse_pipeline
    from sextant.cli.models import load_model, parse_input_shapes
    from sextant.cli.progress import Progress

    if ns.command == "compile" and ns.dump is not None:
        from sextant.cli.dump import parse_stages

        parse_stages(ns.dump)  # a typo in --dump is reported before a long compile, not after
    if ns.command == "run" and ns.runs < 1:
        raise CliError("--runs must be at least 1", "e.g. --runs 20", ExitCode.USAGE)
    pipeline = parse_pipeline(ns.pipeline)
    _check_gpu_name(ns.gpu)
    progress = Progress(err, enabled=not ns.quiet)
    model = load_model(ns.model, parse_input_shapes(ns.input_shape))
    b = build(model, ns.target, arch=ns.arch, pipeline=pipeline, progress=progress, need_gpu=ns.command == "run",
              strict=ns.strict, verbose=ns.verbose)
    code = COMMANDS[ns.command](ns, b, out)
    if ns.report is not None:
        _write_report(b, ns.report, ns.gpu, out)
    return code


def _error_code(e: BaseException) -> tuple[ExitCode, str]:
    """Exit code and hint for an exception sextant raised while compiling."""
    from sextant.codegen.ptxas import PtxasError
    from sextant.errors import ExportError, SextantError, UnsupportedOpError

    if isinstance(e, UnsupportedOpError):
        return ExitCode.COMPILE, "rewrite the model to avoid the op(s) listed, or add a lowering"
    if isinstance(e, ExportError):
        return ExitCode.COMPILE, "torch.export must be able to capture the model (see its message above)"
    if isinstance(e, PtxasError):
        return ExitCode.COMPILE, "ptxas rejected the generated PTX: a sextant bug; report it with MODEL and --verbose"
    if isinstance(e, SextantError):
        return ExitCode.COMPILE, "add --verbose for the traceback"
    return ExitCode.INTERNAL, "this is a bug in sextant: rerun with --verbose and report the traceback"


def report_error(e: BaseException, err: TextIO, verbose: bool) -> int:
    """Print ``e`` as ``error: ...`` / ``hint: ...`` (traceback first when verbose); returns the exit code."""
    if verbose:
        traceback.print_exception(e, file=err)
    if isinstance(e, CliError):
        code, message, hint = e.code, e.message, e.hint
    else:
        code, hint = _error_code(e)
        message = str(e) or type(e).__name__
        if code == ExitCode.INTERNAL:
            message = f"internal error: {type(e).__name__}: {message}"
    print(f"sextant: error: {message}", file=err)
    if hint:
        print(f"hint: {hint}", file=err)
    return int(code)


def main(argv: list[str] | None = None, *, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out, err = out or sys.stdout, err or sys.stderr
    verbose = "-v" in argv or "--verbose" in argv
    try:
        ns = make_parser().parse_args(argv)
    except CliError as e:
        return report_error(e, err, verbose)
    except SystemExit as e:  # --help
        return int(e.code or 0)
    ns.argv = argv
    try:
        with _quiet_warnings(ns.verbose):
            return _execute(ns, out, err)
    except KeyboardInterrupt:
        print("sextant: interrupted", file=err)
        return 130
    except Exception as e:
        return report_error(e, err, ns.verbose)


if __name__ == "__main__":
    sys.exit(main())
