"""flax.training.checkpoints' functions, asynchronous: a one-line swap.

    # from flax.training import checkpoints
    from ckptio import flax as checkpoints

    checkpoints.save_checkpoint(ckpt_dir, state, step, keep=3)   # returns after the snapshot
    state = checkpoints.restore_checkpoint(ckpt_dir, state)
    checkpoints.wait_until_finished()                           # before exit (also done at exit)

Same signatures and behaviour as flax's (the single-host, non-orbax path),
except that ``save_checkpoint`` returns once the state is snapshotted, and
writing, the atomic commit and pruning continue in the background. What
differs, and why:

- The layout: ``<ckpt_dir>/<prefix><step>/`` is a directory (a manifest and
  safetensors shards) rather than one msgpack file; ``save_checkpoint`` and
  ``latest_checkpoint`` return that directory's path, and
  ``restore_checkpoint`` accepts it as flax accepts a file path.
- Steps are integers >= 0 (flax also allows floats; an integral float such
  as 5.0 is accepted and saved as step 5).
- Functions that look at the directory (``restore_checkpoint``,
  ``latest_checkpoint``, ``available_steps``) first wait for this process's
  saves to that directory, so they see what flax's blocking save would have
  left there. ``wait_until_finished()`` waits for every save.
- ``overwrite=True`` deletes the newer checkpoints before the save rather
  than after its commit (ckptio's pruning would otherwise count them as the
  newest and prune the new one).
- One ckptio manager stays open per checkpoint directory, so that saves
  overlap with training. Its staging memory grows to what the saves need
  (``staging_memory="auto"``): a tiny state costs a few pages, and a state
  larger than a capped ``staging_memory`` is written straight from its
  arrays (``save_checkpoint`` then returns once written). ``configure()``
  sets the managers' options (or use $CKPTIO_CONFIG).

- Sharded jax.Arrays (``NamedSharding`` over a ``Mesh``, one process or
  several after ``jax.distributed.initialize``): ``save_checkpoint`` and
  ``save_checkpoint_multiprocess`` write each process's chunks (replicated
  data once), and ``restore_checkpoint`` with a target of jax.Arrays (or
  ``jax.ShapeDtypeStruct(..., sharding=...)``) returns jax.Arrays on the
  target's shardings, reading only what this process's devices hold.

The state is converted with ``flax.serialization.to_state_dict`` (so flax
dataclasses such as TrainState work) when flax is importable, else with an
equivalent for dicts, lists, tuples and namedtuples. Restored arrays are
numpy arrays, as with flax, except where the target holds jax.Arrays.
"""
import concurrent.futures
import math
import os
import re
import threading
from collections.abc import Mapping

from . import _ckptio, _tree
from ._errors import CkptioError
from ._manager import CheckpointManager

try:  # flax itself, when installed: its state dicts and its error class
    from flax import errors as _flax_errors
    from flax import serialization as _flax_serialization
except ImportError:  # plain dicts/lists/tuples still work without flax
    _flax_errors = None
    _flax_serialization = None

__all__ = [
    "save_checkpoint",
    "restore_checkpoint",
    "latest_checkpoint",
    "available_steps",
    "wait_until_finished",
    "configure",
    "close",
    "InvalidCheckpointError",
    "AsyncManager",
]

if _flax_errors is not None:

    class InvalidCheckpointError(CkptioError, _flax_errors.InvalidCheckpointError):
        """A checkpoint at the current or a later step already exists
        (pass overwrite=True to replace it). Also a
        flax.errors.InvalidCheckpointError."""

        code = "AlreadyExists"

        def __init__(self, path, step):
            _flax_errors.InvalidCheckpointError.__init__(self, path, step)

else:

    class InvalidCheckpointError(CkptioError):
        """A checkpoint at the current or a later step already exists
        (pass overwrite=True to replace it)."""

        code = "AlreadyExists"

        def __init__(self, path, step):
            super().__init__(f'Trying to save an outdated checkpoint at step: "{step}" and path: "{path}".')


_SCHEME_RE = re.compile(r"^(?P<scheme>[a-z][a-z0-9.+-]+://)?(?P<path>.*)$", re.I | re.S)
_lock = threading.RLock()
_writers = {}  # directory key -> _Writer
_settings = {"config": None, "options": {}}


def configure(config=None, **options):
    """Options for the managers this module opens from now on: a config
    file and/or keyword overrides (``staging_memory="512MiB"``, ...). The
    writers already open are closed (after their saves) and reopened with
    them on their next save."""
    with _lock:
        _settings["config"] = config
        _settings["options"] = dict(options)
        _close_writers()


def _normpath(path):
    """flax's safe_normpath (os.path.normpath keeping a URL scheme) of a
    directory ckptio accepts as a root; anything else (s3://, gcs://, gs:/b,
    a bare gs://) raises InvalidArgumentError (a ValueError) naming the
    accepted forms, before anything is written."""
    path = os.fspath(path)
    _ckptio.parse_root(path)
    d = _SCHEME_RE.match(path).groupdict()
    return (d["scheme"] or "") + os.path.normpath(d["path"])


def _is_remote(path):
    return "://" in path and not path.startswith("file://")


def _local(path):
    return path[len("file://"):] if path.startswith("file://") else path


def _key(path):
    return path if _is_remote(path) else os.path.abspath(_local(path))


def _join(directory, name):
    return directory.rstrip("/") + "/" + name if _is_remote(directory) else os.path.join(directory, name)


def _int_step(step):
    if isinstance(step, bool):
        raise TypeError(f"step must be a number, got {step!r}")
    if isinstance(step, float):
        if not math.isfinite(step) or step != int(step):
            raise ValueError(f"ckptio saves integer steps, got {step!r}")
        step = int(step)
    if not isinstance(step, int):
        try:
            step = int(step.__index__())
        except AttributeError:
            raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}") from None
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step > 2**63 - 1:
        raise ValueError(f"step must be at most 2**63 - 1 (a signed 64-bit integer), got {step}")
    return step


class _Writer:
    """The open manager of one checkpoint directory, and flax's keep policy
    when keep_every_n_steps asks for one ckptio's does not implement."""

    def __init__(self, directory, prefix, keep, keep_every_n_steps):
        if keep < 0:
            raise ValueError(f"keep must be >= 0, got {keep}")
        self.settings = (prefix, keep, keep_every_n_steps)
        self.keep = keep
        self.keep_every_n_steps = keep_every_n_steps
        # flax's keep_every_n_steps keeps the oldest checkpoint and then each
        # one at least n steps after the last kept; ckptio's keep_every keeps
        # multiples of n. So with it, ckptio keeps everything and flax's rule
        # runs here, on committed checkpoints only.
        options = dict(_settings["options"])
        options.update(prefix=prefix, overwrite=True, keep_every=0,
                       keep=0 if keep_every_n_steps else keep)
        self.manager = CheckpointManager(_local(directory), config=_settings["config"], **options)

    def prune(self):
        if not self.keep_every_n_steps or self.keep <= 0:
            return
        steps = self.manager.all_steps()
        if len(steps) <= self.keep:
            return
        last_kept = -math.inf
        for step in steps[:-self.keep]:
            # As flax: `if step_number and ...`, so step 0 is never kept by it.
            if step and step - last_kept >= self.keep_every_n_steps:
                last_kept = step
                continue
            self.manager.delete(step)

    def wait(self):
        self.manager.wait_until_finished()
        self.prune()


def _writer(directory, prefix, keep, keep_every_n_steps):
    key = _key(directory)
    writer = _writers.get(key)
    if writer is not None and writer.settings != (prefix, keep, keep_every_n_steps):
        _writers.pop(key)
        writer.manager.close()
        writer = None
    if writer is None:
        writer = _Writer(directory, prefix, keep, keep_every_n_steps)
        _writers[key] = writer
    return writer


def _close_writers():
    errors = []
    while _writers:
        _, writer = _writers.popitem()
        try:
            writer.manager.close()
        except CkptioError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def _to_state_dict(target):
    if _flax_serialization is not None:
        return _flax_serialization.to_state_dict(target)
    if isinstance(target, tuple) and hasattr(target, "_fields"):
        return {f: _to_state_dict(getattr(target, f)) for f in target._fields}
    if isinstance(target, Mapping):
        return {str(k): _to_state_dict(v) for k, v in target.items()}
    if isinstance(target, (list, tuple)):
        return {str(i): _to_state_dict(v) for i, v in enumerate(target)}
    return target


def _from_state_dict(target, state, path="."):
    if _flax_serialization is not None:
        return _flax_serialization.from_state_dict(target, state)
    if isinstance(target, tuple) and hasattr(target, "_fields"):
        if set(state) != set(target._fields):
            raise ValueError("The field names of the state dict and the named tuple do not match,"
                             f" got {set(state)} and {set(target._fields)} at path {path}")
        return type(target)(**{k: _from_state_dict(getattr(target, k), state[k], f"{path}/{k}")
                               for k in target._fields})
    if isinstance(target, Mapping):
        missing = set(map(str, target)) - set(state)
        if missing:
            raise ValueError("The target dict keys and state dict keys do not match, target dict"
                             f" contains keys {missing} which are not present in state dict at path {path}")
        return {k: _from_state_dict(v, state[str(k)], f"{path}/{k}") for k, v in target.items()}
    if isinstance(target, (list, tuple)):
        if len(state) != len(target):
            raise ValueError("The size of the list and the state dict do not match,"
                             f" got {len(target)} and {len(state)} at path {path}")
        restored = [_from_state_dict(v, state[str(i)], f"{path}/{i}") for i, v in enumerate(target)]
        return restored if isinstance(target, list) else tuple(restored)
    return state


def _open_reader(directory, prefix):
    """(manager, owned): this process's writer of `directory` once its saves
    are done, or a new read-only manager (owned: close it). None if a local
    directory does not exist."""
    writer = _writers.get(_key(directory))
    if writer is not None:
        writer.wait()
        if writer.settings[0] == prefix:
            return writer.manager, False
    if not _is_remote(directory) and not os.path.isdir(_local(directory)):
        return None, False
    options = dict(_settings["options"], prefix=prefix)
    return CheckpointManager(_local(directory), config=_settings["config"], read_only=True, **options), True


def _steps(directory, prefix):
    manager, owned = _open_reader(directory, prefix)
    if manager is None:
        return []
    try:
        return manager.all_steps()
    finally:
        if owned:
            manager.close()


def _read(directory, prefix, step, target=None):
    manager, owned = _open_reader(directory, prefix)
    if manager is None:
        raise ValueError(f"Matching checkpoint not found: {_join(directory, f'{prefix}{step}')}")
    try:
        return manager.restore(step, target=target)
    finally:
        if owned:
            manager.close()


def _as_checkpoint_path(path, prefix):
    """(directory, step) if `path` names one checkpoint (what save_checkpoint
    and latest_checkpoint return), else None."""
    parent, base = (path.rstrip("/").rsplit("/", 1) + [""])[:2] if _is_remote(path) else os.path.split(path)
    match = re.fullmatch(re.escape(prefix) + r"(\d+)", base)
    if not match or not parent:
        return None
    step = int(match.group(1))
    if step not in _steps(parent, prefix):  # (waits for this process's saves there)
        return None
    if not _is_remote(path) and not os.path.isfile(os.path.join(_local(path), "manifest.json")):
        return None
    return parent, step


class AsyncManager:
    """flax's AsyncManager, for loops that make one and pass it as
    ``save_checkpoint(..., async_manager=am)``: ckptio's saves are in the
    background without it, and ``am.wait_previous_save()`` waits for them
    (as ``wait_until_finished()`` does)."""

    def __init__(self, max_workers=1):
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers)
        self.save_future = None

    def wait_previous_save(self):
        if self.save_future is not None:
            self.save_future.result()
        wait_until_finished()

    def save_async(self, task):
        """Runs ``task`` on the executor, after the previous one (as flax's)."""
        self.wait_previous_save()
        self.save_future = self.executor.submit(task)


def save_checkpoint(ckpt_dir, target, step, prefix="checkpoint_", keep=1, overwrite=False,
                    keep_every_n_steps=None, async_manager=None, orbax_checkpointer=None):
    """Saves ``target`` as checkpoint ``step`` in ``ckpt_dir``; returns the
    checkpoint's path as soon as the state is snapshotted. ``async_manager``
    and ``orbax_checkpointer`` are accepted and ignored: every save is in the
    background anyway.

    keep: checkpoints to keep (0 keeps all); keep_every_n_steps: also keep
    one every n steps; overwrite: allow a step at or below the latest one
    (newer checkpoints are deleted). Raises InvalidCheckpointError when a
    checkpoint of this or a later step exists and overwrite is False, and
    the error of an earlier background save if it failed."""
    del async_manager, orbax_checkpointer
    ckpt_dir = _normpath(ckpt_dir)
    step = _int_step(step)
    ckpt_path = _join(ckpt_dir, f"{prefix}{step}")
    with _lock:
        writer = _writer(ckpt_dir, prefix, keep, keep_every_n_steps)
        manager = writer.manager
        if not overwrite:
            existing = set(manager.all_steps()) | set(manager.saves_in_flight())
            if existing and step <= max(existing):
                raise InvalidCheckpointError(ckpt_path, step)
        else:
            if any(s >= step for s in manager.saves_in_flight()):
                manager.wait_until_finished()
            for newer in [s for s in manager.all_steps() if s > step]:
                manager.delete(newer)
        manager.save(step, _to_state_dict(target))
        writer.prune()
    return ckpt_path


def save_checkpoint_multiprocess(ckpt_dir, target, step, prefix="checkpoint_", keep=1, overwrite=False,
                                 keep_every_n_steps=None, async_manager=None, gda_manager=None,
                                 orbax_checkpointer=None):
    """flax's multi-process save: every process calls it with the same tree
    of global (sharded) jax.Arrays; each writes the chunks it holds and the
    processes commit one checkpoint (jax.distributed gives the process index,
    count and barrier). ``async_manager``, ``gda_manager`` and
    ``orbax_checkpointer`` are accepted and ignored: ckptio saves in the
    background anyway."""
    del async_manager, gda_manager, orbax_checkpointer
    return save_checkpoint(ckpt_dir, target, step, prefix=prefix, keep=keep, overwrite=overwrite,
                           keep_every_n_steps=keep_every_n_steps)


def restore_checkpoint(ckpt_dir, target, step=None, prefix="checkpoint_", parallel=True, gda_manager=None,
                       allow_partial_mpa_restoration=False, orbax_checkpointer=None, orbax_transforms=None):
    """Restores the latest checkpoint in ``ckpt_dir`` (or ``step``), or the
    checkpoint ``ckpt_dir`` names. Returns ``target`` updated from it (the
    state dict if ``target`` is None), or ``target`` unchanged when there is
    no checkpoint and no step was asked for. Raises ValueError if ``step``
    does not exist. ``parallel``, ``gda_manager``,
    ``allow_partial_mpa_restoration`` and ``orbax_checkpointer`` are
    accepted and ignored (reads are parallel; a target that is a part of the
    checkpoint restores that part); ``orbax_transforms`` is not supported."""
    del parallel, gda_manager, allow_partial_mpa_restoration, orbax_checkpointer
    if orbax_transforms:
        raise NotImplementedError("restore_checkpoint: orbax_transforms is not supported by ckptio.flax; restore "
                                  "without it and transform the returned state")
    ckpt_dir = _normpath(ckpt_dir)
    with _lock:
        if step is not None:
            step = _int_step(step)
            directory = ckpt_dir
            if step not in _steps(directory, prefix):
                raise ValueError(f"Matching checkpoint not found: {_join(ckpt_dir, f'{prefix}{step}')}")
        else:
            named = _as_checkpoint_path(ckpt_dir, prefix)
            if named is not None:
                directory, step = named
            else:
                directory = ckpt_dir
                steps = _steps(directory, prefix)
                if not steps:
                    return target
                step = steps[-1]
        # A target of (sharded) jax.Arrays or ShapeDtypeStructs is read onto
        # its shardings: each process reads only what its devices hold.
        wanted = _to_state_dict(target) if target is not None else None
        state = _read(directory, prefix, step, wanted if wanted is not None and _tree.has_jax_leaves(wanted) else None)
    if target is None:
        return state
    return _from_state_dict(target, state)


def latest_checkpoint(ckpt_dir, prefix="checkpoint_"):
    """The path of the latest checkpoint in ``ckpt_dir``, or None."""
    ckpt_dir = _normpath(ckpt_dir)
    with _lock:
        steps = _steps(ckpt_dir, prefix)
    return _join(ckpt_dir, f"{prefix}{steps[-1]}") if steps else None


def available_steps(ckpt_dir, prefix="checkpoint_", step_type=int):
    """Steps of the checkpoints in ``ckpt_dir``, ascending."""
    ckpt_dir = _normpath(ckpt_dir)
    with _lock:
        steps = _steps(ckpt_dir, prefix)
    return [step_type(s) for s in steps]


def wait_until_finished():
    """Blocks until every save made through this module has committed (and
    old checkpoints are pruned); raises the first failure. Ctrl-C interrupts
    the wait; the saves carry on in the background."""
    with _lock:
        writers = list(_writers.values())
    errors = []
    for writer in writers:
        try:
            writer.wait()
        except CkptioError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def close():
    """Waits for the saves, then closes every manager this module opened
    (releasing the directories' locks and the staging memory)."""
    with _lock:
        _close_writers()
