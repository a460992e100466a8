"""rdep's exceptions: one class per rdep status code (include/rdep/status.h).

InvalidArgument is a ValueError (the caller passed something wrong); every other code is a RuntimeError.
All of them derive from RdepError, so `except rdep.RdepError` catches whatever the C library reported.
"""

from __future__ import annotations


class RdepError(Exception):
    """An error reported by the rdep C library. `code` is its rdep status code."""

    code: int = -1


class InvalidArgumentError(RdepError, ValueError):
    code = 1


class FailedPreconditionError(RdepError, RuntimeError):
    code = 2


class RdepTimeoutError(RdepError, RuntimeError):
    """A peer rank did not arrive within the barrier bound."""

    code = 3


class UnavailableError(RdepError, RuntimeError):
    """A backend or device that is not present (e.g. the CUDA backend in a host-only build)."""

    code = 4


class InternalError(RdepError, RuntimeError):
    code = 5


class CudaError(RdepError, RuntimeError):
    code = 6


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        FailedPreconditionError,
        RdepTimeoutError,
        UnavailableError,
        InternalError,
        CudaError,
    )
}


class UnknownStatusError(RdepError, RuntimeError):
    pass


def error_for_code(code: int, message: str) -> RdepError:
    """The exception for an rdep status code (an unknown code gives UnknownStatusError)."""
    cls = _BY_CODE.get(code, UnknownStatusError)
    err = cls(message)
    err.code = code
    return err
