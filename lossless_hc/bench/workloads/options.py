"""The training driver's command line, apart from its options (lossless_hc.bench.workloads.train): which
launcher started this process, the ``type=`` functions that check option values, and an argparse parser
whose error is one line. A user's mistake ends at argument parsing, on every rank, as one line naming the
option and what it takes -- not as a traceback per rank once the process group exists, nor as a run that
silently does something else.
"""
from __future__ import annotations

import argparse
import io
import math
import sys
import textwrap
from contextlib import redirect_stderr
from typing import Callable, Optional, Sequence

import torch


# -- launchers -------------------------------------------------------------------------------------
# What started this process, from the environment its launcher set: torchrun (TORCHELASTIC_RUN_ID) or
# torch.distributed's env:// variables (the cluster benchmark sets them itself) start torch.distributed
# workers; horovodrun (HOROVOD_RANK) and mpirun (its rank variables) start Horovod workers. Horovod under
# torchrun does not fail: every process is a 1-rank job of its own, which trains and exits 0; DDP under
# horovodrun fails in init_process_group, on every rank. Hence a refusal at parsing, naming the right launcher.
TORCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")   # Open MPI, MPICH / Intel MPI, PMIx
LAUNCH_SCRIPTS = {"torch": "scripts/launch_torchrun.sh", "horovod": "scripts/launch_horovod.sh (horovodrun) or "
                  "scripts/launch_mpirun.sh (mpirun)"}
NEEDS = {"horovod": "horovod", "ddp": "torch", "fsdp": "torch"}   # local: runs under any launcher


def detect_launcher(env) -> tuple:
    """``(kind, what)`` of the launcher that started this process, from the environment ``env``: kind
    ``"torch"`` (torchrun, or torch.distributed's env:// variables all set) or ``"horovod"`` (horovodrun,
    mpirun), ``what`` naming the evidence; ``(None, None)`` for a plain process. torchrun's own variable
    wins (an srun or mpirun around torchrun leaves its rank variables in the workers' environment)."""
    if "TORCHELASTIC_RUN_ID" in env:
        return "torch", "torchrun"
    if "HOROVOD_RANK" in env:
        return "horovod", "horovodrun"
    if all(k in env for k in TORCH_ENV):
        return "torch", "torch.distributed's env:// variables (" + ", ".join(TORCH_ENV) + ")"
    for var in MPI_RANK_VARS:
        if var in env:
            return "horovod", f"mpirun ({var})"
    return None, None


def launch_error(framework: str, env) -> Optional[str]:
    """Why ``--framework framework`` cannot run under this process's launcher (None: it can)."""
    kind, what = detect_launcher(env)
    need = NEEDS.get(framework)
    if kind is None or need is None or kind == need:
        return None
    if kind == "torch":
        why, instead = "starts torch.distributed workers (each would be a 1-rank Horovod job)", "ddp|fsdp"
    else:
        why, instead = "starts Horovod workers and does not set up torch.distributed", "horovod"
    return (f"--framework {framework}: this process was started by {what}, which {why}; launch {framework} "
            f"with {LAUNCH_SCRIPTS[need]}, or pass --framework {instead}")


def local_rank(env) -> int:
    """This process's rank on its machine, as its launcher set it (0 for a plain process)."""
    for var in ("LOCAL_RANK", "HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        if var in env:
            return int(env[var])
    return 0


# -- option values: argparse ``type=`` functions, so that a bad value is one line naming the option --
def _number(kind):
    """A ``type=`` for ``kind`` (int or float; a float must be finite: NaN would pass every range check)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        return value
    return parse


def _bounded(kind, low, what: str, strict: bool = False, high=None):
    """A ``type=`` for ``kind`` values >= low (> low when ``strict``) and <= high; ``what`` says so."""
    number = _number(kind)

    def parse(text: str):
        value = number(text)
        if value < low or (strict and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value
    return parse


positive_int = _bounded(int, 1, "a positive integer")
non_negative_int = _bounded(int, 0, "an integer >= 0")
non_negative_float = _bounded(float, 0.0, "a finite number >= 0")
fraction = _bounded(float, 0.0, "a number in (0, 1]", strict=True, high=1.0)   # as lhc.layout.check_fraction


def thc_bits(text: str) -> int:
    """``--thc-bits``: what THC's tables accept (lossless_hc.thc.table.check_bits: an integer in [1, 16])."""
    from lossless_hc.thc.table import check_bits

    value = _number(int)(text)
    try:
        check_bits(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("bits must be", "must be")) from None
    return value


def device(text: str) -> str:
    """``--device``: cpu, or cuda where this torch sees a CUDA device."""
    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"cuda: this torch ({torch.__version__}) sees no CUDA device "
                                         "(torch.cuda.is_available() is False); use --device cpu")
    return text


class UsageError(SystemExit):
    """A refused command line: exit status 2, ``message`` the reason (already printed on stderr)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


class HelpFormatter(argparse.HelpFormatter):
    """Wraps help text at spaces only: a mode such as topk-allgather stays on one line."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose error is one line, ``PROG: error: MESSAGE (see --help)``, raised as :class:`UsageError`:
    every rank of a launch prints it, so argparse's usage block would come once per rank."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
        raise UsageError(message)


def refusal(parse: Callable, argv: Sequence[str]) -> Optional[str]:
    """Why ``parse(argv)`` (a parse_args built on :class:`ArgumentParser`) refuses ``argv``, or None; its line
    on stderr is kept quiet. Parses only: nothing starts."""
    try:
        with redirect_stderr(io.StringIO()):
            parse(list(argv))
    except UsageError as exc:
        return exc.message
    return None
