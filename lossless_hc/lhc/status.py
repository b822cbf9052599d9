"""DecodeStatus: the one vocabulary of decode outcomes.

The list is declared once, in ``csrc/lhc_status.h``; the CPU kernels return its codes, the CUDA
backend maps its kernels' verdict onto the same codes, and this enum is built from the compiled
module's copy of that list, so C++, CUDA and Python cannot drift apart. ``DecodeReport.status``
carries it: callers branch on the status, never on the message text.
"""
from __future__ import annotations

import enum

from lossless_hc.backends.cpu import decode_statuses

DecodeStatus = enum.IntEnum("DecodeStatus", [(name, code) for name, code, _ in decode_statuses()])
DecodeStatus.__doc__ = "Outcome of a decode (csrc/lhc_status.h); OK is the only exact one."
DecodeStatus.__module__ = __name__

MESSAGES = {DecodeStatus(code): message for _, code, message in decode_statuses()}


def message(status: int) -> str:
    """The reason text of ``status`` (empty for OK)."""
    try:
        return MESSAGES[DecodeStatus(status)]
    except ValueError:
        return f"unknown decode status {status}"
