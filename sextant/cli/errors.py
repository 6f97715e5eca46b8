"""The command's exit codes and its one error type: a message plus the hint of what to do."""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    COMPILE = 1  # the model cannot be compiled: unsupported op, export failure, code generation error
    USAGE = 2  # bad option, or MODEL cannot be found or loaded
    MISMATCH = 3  # `run`: the compiled model's outputs differ from eager PyTorch beyond the tolerance
    ENVIRONMENT = 4  # something the machine lacks: ptxas, a GPU, an optional package
    INTERNAL = 5  # a bug in sextant itself


EXIT_CODES_HELP = """exit codes:
  0  success
  1  the model cannot be compiled (unsupported op, torch.export failure, code generation error)
  2  usage error: bad option, or MODEL not found / its factory fails / returns the wrong thing
  3  run: outputs differ from eager PyTorch beyond --atol/--rtol
  4  the environment lacks something: ptxas, a GPU (--target cuda), an optional package
  5  internal error in sextant (a bug: rerun with --verbose and report the traceback)"""


class CliError(Exception):
    """An error the command reports as ``error: MESSAGE`` and ``hint: HINT``, then exits with ``code``."""

    def __init__(self, message: str, hint: str = "", code: ExitCode = ExitCode.COMPILE) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.code = code
