"""Exceptions raised by ckptio: one class per C++ status code.

Every class derives from CkptioError, and where a builtin says the same thing
from that builtin too, so ``except FileNotFoundError`` catches a missing step
and ``except ValueError`` a bad argument. ``str(e)`` is the C++ message,
``e.code`` the status code's name ("NotFound", "NoSpace", ...).
"""


class CkptioError(Exception):
    """Base class of every error ckptio raises from its C++ core."""

    code = "Unknown"

    def __init__(self, message, code=None):
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgumentError(CkptioError, ValueError):
    code = "InvalidArgument"


class NotFoundError(CkptioError, FileNotFoundError):
    code = "NotFound"


class AlreadyExistsError(CkptioError, FileExistsError):
    code = "AlreadyExists"


class FailedPreconditionError(CkptioError):
    code = "FailedPrecondition"


class CorruptionError(CkptioError):
    code = "Corruption"


class IoError(CkptioError, OSError):
    code = "IoError"


class NoSpaceError(CkptioError, OSError):
    code = "NoSpace"


class PermissionDeniedError(CkptioError, PermissionError):
    code = "PermissionDenied"


class UnavailableError(CkptioError):
    code = "Unavailable"


class DeadlineExceededError(CkptioError, TimeoutError):
    code = "DeadlineExceeded"


class CancelledError(CkptioError):
    code = "Cancelled"


class ResourceExhaustedError(CkptioError):
    code = "ResourceExhausted"


class UnimplementedError(CkptioError, NotImplementedError):
    code = "Unimplemented"


class InternalError(CkptioError):
    code = "Internal"


_BY_CODE = {
    cls.code: cls
    for cls in (
        InvalidArgumentError, NotFoundError, AlreadyExistsError, FailedPreconditionError,
        CorruptionError, IoError, NoSpaceError, PermissionDeniedError, UnavailableError,
        DeadlineExceededError, CancelledError, ResourceExhaustedError, UnimplementedError,
        InternalError,
    )
}


def make_error(code, message):
    """The exception for a C++ Status (called by the extension)."""
    return _BY_CODE.get(code, CkptioError)(message, code)
