"""ckptio: asynchronous checkpoints for JAX, NumPy and PyTorch trainers.

    import ckptio
    mgr = ckptio.CheckpointManager("/data/ckpt", keep=3)   # or "gs://bucket/run7"
    mgr.save(step, {"params": params, "opt_state": opt_state})   # returns after the snapshot
    ...
    mgr.wait_until_finished()
    state = mgr.restore()                  # the latest step, as numpy arrays
    state = mgr.restore(target=state)      # shaped like a target

For flax users, ``ckptio.flax`` has ``save_checkpoint`` / ``restore_checkpoint``
/ ``latest_checkpoint`` with flax.training.checkpoints' signatures.
"""
from . import _ckptio
from ._errors import (
    AlreadyExistsError,
    CancelledError,
    CkptioError,
    CorruptionError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidArgumentError,
    IoError,
    NoSpaceError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnavailableError,
    UnimplementedError,
    make_error as _make_error,
)
from ._manager import CheckpointManager

_ckptio._set_error_factory(_make_error)

SaveHandle = _ckptio.SaveHandle
__version__ = _ckptio.__version__

__all__ = [
    "CheckpointManager",
    "SaveHandle",
    "CkptioError",
    "AlreadyExistsError",
    "CancelledError",
    "CorruptionError",
    "DeadlineExceededError",
    "FailedPreconditionError",
    "InternalError",
    "InvalidArgumentError",
    "IoError",
    "NoSpaceError",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "UnavailableError",
    "UnimplementedError",
]
