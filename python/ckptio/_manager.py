"""CheckpointManager: pytrees in, asynchronous atomic checkpoints out."""
import atexit
import contextlib
import json
import numbers
import os
import sys
import threading
import weakref

import numpy as np

from . import _ckptio, _dtypes, _jax, _torch, _tree
from ._errors import CkptioError, NotFoundError

# Managers still open, closed (their saves waited for) when the interpreter exits.
_live = weakref.WeakSet()


def _flatten_options(options, prefix=""):
    """{"io": {"direct": False}} -> {"io.direct": False} (dotted keys pass through)."""
    flat = {}
    for key, value in options.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path != "gcs.headers":
            flat.update(_flatten_options(value, path + "."))
        else:
            flat[path] = value
    return flat


_MAX_STEP = 2**63 - 1  # steps are signed 64-bit integers on disk and in C++


def _check_step(step):
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step > _MAX_STEP:
        raise ValueError(f"step must be at most 2**63 - 1 (a signed 64-bit integer), got {step}")
    return int(step)


def _metadata_json(meta):
    try:
        return json.dumps(meta, separators=(",", ":"), allow_nan=False)
    except ValueError as e:  # NaN or infinity: JSON has no spelling for them
        raise ValueError(f"metadata cannot be stored as JSON: {e} (NaN and infinity are not JSON; "
                         "store them as strings, e.g. \"nan\")") from None


class CheckpointManager:
    """Asynchronous, atomic, pruned checkpoints of pytrees under one root.

    ``root`` is a directory (created if needed) or ``gs://bucket/prefix``.
    ``keep`` / ``keep_every`` and any other option of the config file
    (``staging_memory="512MiB"``, ``prefix="ckpt_"``, ``io={"direct": False}``,
    ...) given as keyword arguments override the values of ``config`` (a JSON
    config file; default: $CKPTIO_CONFIG if set, else the defaults).

    One writer per root: opening a root another manager (in this process or
    another) holds fails; ``read_only=True`` opens it without the lock, to
    restore while a trainer writes.

    Multi-host: every process opens the same root with ``process_index`` and
    ``process_count`` and saves its own part of the state (tensor names unique
    across processes); process 0 commits one checkpoint. ``barrier`` is a
    callable ``barrier(name)`` that returns once every process has called it
    with that name, e.g. ``lambda name: multihost_utils.sync_global_devices(name)``;
    ckptio calls it on a thread of its own (the callable's own timeout
    applies). Without one, the processes poll the storage for each other.
    ``allgather(name, data)`` returns every process's ``data`` (bytes), in
    process order: two tiers (``tiers={"remote": ...}``) over several
    processes need it, as each host's local tier gets the whole manifest.
    After ``jax.distributed.initialize()`` all four come from jax (its
    coordination service's barrier and key-value store).

    Every method releases the GIL while ckptio works. ``close()`` (or the end
    of a ``with`` block) waits for saves in flight and releases the lock and
    the staging memory; managers still open at exit are closed then.
    """

    def __init__(self, root, keep=None, keep_every=None, config=None, *, read_only=False,
                 process_index=None, process_count=None, barrier=None, allgather=None, **options):
        overrides = {}
        if keep is not None:
            overrides["keep"] = keep
        if keep_every is not None:
            overrides["keep_every"] = keep_every
        overrides.update(_flatten_options(options))
        if process_index is None and process_count is None:
            # jax.distributed.initialize() ran, or torch.distributed has a default
            # process group: its processes, its barrier and all-gather.
            defaults = _jax.distributed_defaults(os.fspath(root)) or _torch.distributed_defaults(os.fspath(root))
            if defaults is not None:
                process_index, process_count, default_barrier, default_allgather = defaults
                if barrier is None:
                    barrier, allgather = default_barrier, allgather or default_allgather
        self._process = (process_index or 0, process_count or 1)
        if process_index is not None:
            overrides["multihost.process_index"] = process_index
        if process_count is not None:
            overrides["multihost.process_count"] = process_count
        if barrier is not None and not callable(barrier):
            raise TypeError(f"barrier must be a callable barrier(name), got {type(barrier).__name__}")
        if allgather is not None and not callable(allgather):
            raise TypeError(f"allgather must be a callable allgather(name, data) -> list of bytes, "
                            f"got {type(allgather).__name__}")
        pairs = [(path, json.dumps(value)) for path, value in overrides.items()]
        config = "" if config is None else os.fspath(config)
        self._m = _ckptio.Manager(os.fspath(root), config, pairs, read_only, barrier, allgather)
        # Two tiers over several processes: each host keeps local copies of
        # what it holds and another process writes.
        self._per_host = self._process[1] > 1 and bool(self.options.get("tiers", {}).get("remote"))
        self._handles = []
        self._handles_lock = threading.Lock()
        self._device_staging = None  # pinned host memory for torch tensors on a GPU, made on first use
        # snapshot "background": save() returns before the copy into staging.
        self._background = self.options.get("snapshot") == "background"
        _live.add(self)

    # --- saving -----------------------------------------------------------

    def save(self, step, tree, metadata=None):
        """Snapshots ``tree`` as checkpoint ``step``; returns once the snapshot
        is taken (the arrays may change right away), while writing, the commit
        and pruning run in the background. ``metadata``: anything JSON can
        encode, returned by ``metadata(step)``.

        With ``snapshot="background"`` (an option of the manager), save()
        returns before the copy into staging, which runs on a ckptio thread:
        change nothing saved until ``wait_snapshots()`` (or the handle's
        ``wait_snapshot()``) returns. A torch tensor changed in place before
        its copy was done fails that save (never a torn checkpoint), naming
        it; numpy arrays have no such check.

        Returns a SaveHandle (``.done()``, ``.wait()``, ``.wait_snapshot()``,
        ``.error()``, ``.timings``). Raises on bad input, a step already
        committed, or the failure of an earlier background save (reported
        once)."""
        step = _check_step(step)
        if self._device_staging is None and "torch" in sys.modules:
            self._device_staging = _torch.DeviceStaging()
        if self._background and self._device_staging is not None and self._device_staging.in_use:
            self._m.wait_snapshots()  # an earlier copy may still read the pinned host copies
        names, dtypes, arrays, chunks, local, description, immutable, watched = _tree.flatten(
            tree, *self._process, device_staging=self._device_staging, local_copies=self._per_host)
        meta = {_tree.TREE_KEY: description}
        if metadata is not None:
            meta[_tree.USER_KEY] = metadata
        chunks = chunks if any(c is not None for c in chunks) else None
        local = local if any(local) else None
        # A state of jax.Arrays (and scalars) is borrowed, not copied: the
        # trainer waits for nothing but the device-to-host transfers.
        # Torch tensors copied from their own memory: refused if changed during the copy.
        check = _torch.snapshot_check(watched, step) if watched and not immutable else None
        handle = self._m.save(step, names, dtypes, arrays, _metadata_json(meta), chunks, immutable, local, check)
        with self._handles_lock:
            self._handles = [h for h in self._handles if not h.done()] + [handle]
        return handle

    def wait_snapshots(self):
        """Blocks until the copy of every save so far is taken, when the saved
        arrays may change: with ``snapshot="background"``, call it before the
        optimizer step (``ckptio.torch.wait_before_step`` registers that);
        returns at once otherwise. A failed copy is raised by the handle's
        ``wait()`` and the next save()."""
        self._m.wait_snapshots()

    def wait_until_finished(self, tier="local"):
        """Blocks until every save has committed (and pruning is done); raises
        the first background failure not yet reported. Ctrl-C interrupts the
        wait (KeyboardInterrupt); the saves carry on in the background.
        With two tiers (config "tiers"), tier="remote" also waits until the
        committed steps are copied to the remote tier (before a planned
        shutdown, say), and the copy of the remote tier's newest step into
        this one (tiers.seed_local) is made; their failures are raised too."""
        if tier == "local":
            self._m.wait_until_finished()
        elif tier == "remote":
            self._m.wait_until_replicated()
        else:
            raise ValueError(f"tier must be 'local' or 'remote', got {tier!r}")

    def saves_in_flight(self):
        """Steps of the saves made through this object that have not ended."""
        with self._handles_lock:
            return [h.step for h in self._handles if not h.done()]

    # --- reading ----------------------------------------------------------

    @contextlib.contextmanager
    def _reading(self):
        """A restore of several calls (batches, buffers allocated between
        them): the background pre-fault of an explicit staging_memory waits
        until it ends, so that the restore's fresh memory comes first
        (CheckpointManager::HoldPrefault)."""
        self._m.hold_prefault()
        try:
            yield
        finally:
            self._m.release_prefault()

    def restore(self, step=None, target=None):
        """Checkpoint ``step`` (default: the latest), every CRC32C checked.

        Without ``target``: the tree as saved (dicts, lists, tuples, named
        tuples, scalars), arrays as numpy arrays. With ``target``: shaped like
        it (its containers, Python scalars where it has them; a leaf whose
        shape differs from the checkpoint's raises ValueError).

        A save of that step (or, for the latest, any save) made through this
        manager and still in flight is waited for first."""
        with self._reading():
            return self._restore(step, target)

    def _restore(self, step, target):
        step = self._step_to_read(step)
        metadata_json, listed = self._m.tensors(step)  # the manifest, read once here
        catalog = _jax.Catalog(listed)
        description = self._description(metadata_json)
        if target is not None and _tree.has_torch_leaves(target):
            arrays = self._read_for_torch(step, target, catalog)
        elif catalog.chunked or (target is not None and _tree.has_jax_leaves(target)):
            arrays = self._read_arrays(step, target, catalog, description)
        else:
            _, _, tensors = self._m.restore(step, _dtypes.table({entry[1] for entry in listed}))
            arrays = dict(tensors)
        if target is not None:
            return _tree.like(target, arrays, None if description is _NO_TREE else description)
        if not _describes(description, set(arrays)):
            return _tree.nest(arrays)
        return _tree.unflatten(description, arrays)

    def restore_into(self, step, tree):
        """Fills the tensors of ``tree`` (torch tensors, DTensors, writable
        numpy arrays) in place with checkpoint ``step`` (None: the latest),
        every CRC32C checked, and returns the step read. The bytes are read
        straight into the tensors' memory where a tensor is a contiguous CPU
        tensor of the checkpoint's dtype (a model's parameters, an
        optimizer's state: ``restore_into(step, {"model": model.state_dict(),
        ...})`` needs no ``load_state_dict`` for them); others (another
        dtype, a GPU, a non-contiguous view) through a host temporary and
        ``copy_``. A DTensor gets the part of the tensor its rank holds.
        Python scalars, strings and None in the tree's dicts and lists are
        replaced by the checkpoint's. A leaf whose shape differs from the
        checkpoint's, or that the checkpoint lacks, raises ValueError naming it."""
        with self._reading():
            return self._restore_into(step, tree)

    def _restore_into(self, step, tree):
        step = self._step_to_read(step)
        metadata_json, listed = self._m.tensors(step)
        catalog = _jax.Catalog(listed)
        description = self._description(metadata_json)
        values = _tree._values_by_name(description) if description is not _NO_TREE else {}
        reads = _torch.Reads(self._m, step, catalog)
        missing = []
        for name, container, key, leaf in _torch.walk(tree):
            if name not in catalog:
                if name in values and container is not None:
                    container[key] = values[name]
                elif name not in values:
                    missing.append(name)
                continue
            if _torch.is_tensor(leaf):
                _torch.fill(reads, name, leaf)
            elif isinstance(leaf, np.ndarray):
                _torch.check_shape(name, leaf.shape, catalog.arrays[name][1])
                if not leaf.flags.writeable:
                    raise ValueError(f"tensor {name!r}: the target numpy array is read-only")
                reads.into(name, (0,) * leaf.ndim, leaf)
            elif container is not None:  # a scalar, a string or None: replaced
                kind = (_tree._leaf_kinds(description).get(name) if description is not _NO_TREE else None) \
                    or _tree._ARRAY
                dtype, shape, _ = catalog.arrays[name]
                temp = np.empty(shape, _dtypes.numpy_dtype(dtype))
                reads.into(name, (0,) * len(shape), temp,
                           done=lambda c=container, k=key, t=temp, kd=kind: c.__setitem__(k, _tree._leaf_value(t, kd)))
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise ValueError(f"the checkpoint has no tensor for {len(missing)} leaf(s) of the target: {shown}")
        reads.run()
        return step

    def _read_for_torch(self, step, target, catalog):
        """name -> restored leaf for a target holding torch tensors: a tensor
        of the target's dtype and device for each torch leaf (a DTensor on its
        mesh for a DTensor leaf), numpy arrays for the others; only what the
        target names is read."""
        reads = _torch.Reads(self._m, step, catalog)
        arrays, builds = {}, []
        for name, leaf in _tree.named_leaves(target):
            if name not in catalog:
                continue  # _tree.like reports it, or takes it from the description
            if _torch.is_tensor(leaf):
                builds.append((name, _torch.plan_target(reads, name, leaf)))
            else:
                dtype, shape, _ = catalog.arrays[name]
                arrays[name] = np.empty(shape, _dtypes.numpy_dtype(dtype))
                reads.into(name, (0,) * len(shape), arrays[name])
        reads.run()
        for name, build in builds:
            arrays[name] = build()
        return arrays

    def _step_to_read(self, step):
        """``step`` checked, or (None) the latest committed one; a save of it
        (of any step, for the latest) made through this manager and still in
        flight is waited for first."""
        if step is not None:
            step = _check_step(step)
        in_flight = self.saves_in_flight()
        if in_flight and (step is None or step in in_flight):
            self.wait_until_finished()
        if self._m.read_only and step is None:
            self._m.refresh()
        if step is None:
            step = self._m.latest_step()
            if step is None:
                raise NotFoundError(f"no committed checkpoint in {self.root}", "NotFound")
        return step

    def _skeleton(self, step):
        """The tree of checkpoint ``step`` (already a _step_to_read) as a
        target, each leaf a placeholder that restores it as saved (reads
        nothing but the manifest)."""
        metadata_json, listed = self._m.tensors(step)
        names = set(_jax.Catalog(listed).arrays)
        description = self._description(metadata_json)
        if not _describes(description, names):
            return _tree.nest({name: _tree.AS_SAVED for name in names})
        return _tree.skeleton(description)

    def _read_arrays(self, step, target, catalog, description):
        """name -> array by ranged reads: for a checkpoint holding sharded
        arrays, or a target asking for jax.Arrays. Only the arrays the target
        names are read (all the tree's without one), and for a sharded target
        only what this process's devices hold."""
        reads = _jax.Reads(catalog)
        arrays, pending = {}, []

        def plan(name, build):
            # Built as soon as their batch is read: the host buffers of a
            # batch go once its arrays are on their devices.
            pending.append((name, build))
            if reads.full():
                flush()

        def flush():
            reads.run(self._m, step)
            for key, build in pending:
                arrays[key] = build()
            pending.clear()

        if target is None:
            names = set(catalog.arrays)
            if description is not _NO_TREE and _tree.leaf_names(description) <= names:
                names = _tree.leaf_names(description)
            for name in names:
                plan(name, _jax.plan_whole(reads, name))
        else:
            for name, leaf in _tree.named_leaves(target):
                if name not in catalog:
                    continue  # _tree.like reports it, or takes it from the description
                if _jax.is_sharded_target(leaf):
                    plan(name, _jax.plan_sharded(reads, name, leaf))
                else:
                    plan(name, _jax.plan_whole(reads, name))
        flush()
        return arrays

    def metadata(self, step=None):
        """The ``metadata`` given to ``save`` (the whole metadata object for a
        checkpoint written by C++ or the command line)."""
        step = self.latest_step() if step is None else _check_step(step)
        if step is None:
            raise NotFoundError(f"no committed checkpoint in {self.root}", "NotFound")
        meta = json.loads(self._m.info(step)["metadata_json"] or "{}")
        if isinstance(meta, dict) and _tree.TREE_KEY in meta:
            return meta.get(_tree.USER_KEY)
        return meta

    def latest_step(self):
        """The newest committed step, or None."""
        if self._m.read_only:
            self._m.refresh()
        return self._m.latest_step()

    def all_steps(self, tier=None):
        """Committed steps, ascending: of either tier (two tiers, config
        "tiers"), or of tier="local" or tier="remote" only."""
        if self._m.read_only:
            self._m.refresh()
        if tier is None:
            return list(self._m.all_steps())
        if tier not in ("local", "remote"):
            raise ValueError(f"tier must be 'local' or 'remote', got {tier!r}")
        return list(self._m.tier_steps(tier == "remote"))

    def info(self, step):
        return self._m.info(_check_step(step))

    def verify(self, step=None):
        """Re-reads every byte of a checkpoint and checks every CRC32C."""
        return self._m.verify(None if step is None else _check_step(step))

    def delete(self, step):
        self._m.delete(_check_step(step))

    def stats(self):
        return self._m.stats()

    @property
    def options(self):
        """The effective options (config file + keyword overrides), as the
        config file would spell them."""
        return json.loads(self._m.options_json())

    @property
    def root(self):
        return self._m.root

    @property
    def read_only(self):
        return self._m.read_only

    @property
    def closed(self):
        return self._m.closed

    # --- lifetime ---------------------------------------------------------

    def close(self):
        """Waits for saves in flight, then releases the root's lock, the
        staging memory and the threads. Raises a background failure."""
        self._m.close()
        _live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else ("read-only" if self.read_only else "open")
        return f"<ckptio.CheckpointManager {self.root!r} {state}>"

    def _description(self, metadata_json):
        try:
            meta = json.loads(metadata_json or "{}")
        except ValueError:
            return _NO_TREE
        if isinstance(meta, dict) and _tree.TREE_KEY in meta:
            return meta[_tree.TREE_KEY]
        return _NO_TREE


_NO_TREE = object()


def _describes(description, names):
    """Whether the stored tree `description` is that of exactly the tensors
    `names`. It is not for a checkpoint written by C++ or the CLI (no tree),
    nor by several processes (the tree stored is process 0's part): those
    restore as nested dicts by name."""
    return description is not _NO_TREE and _tree.leaf_names(description) == names


def _close_all_at_exit():
    """Waits for the saves still in flight before the interpreter exits, so a
    trainer that returns from main() does not cut its last save short. A
    Ctrl-C here abandons them: the newest committed checkpoint stays intact
    (a commit is atomic), and the debris is removed when the root is opened
    again.

    A save that failed in the background and was never raised to the program
    is printed here, every failed step of it, and makes the process exit with
    status 1 (after the rest of Python's shutdown), so that a batch job or CI
    does not see success."""
    managers = [m for m in list(_live) if not m.closed]
    if not managers:
        return
    try:
        if any(m.saves_in_flight() for m in managers):
            print("ckptio: waiting for checkpoint saves in flight to commit (Ctrl-C to abandon them)",
                  file=sys.stderr, flush=True)
        for m in managers:
            try:
                m.close()
            except CkptioError as e:
                print(f"ckptio: checkpoint saves to {m.root} failed in the background: {e}", file=sys.stderr,
                      flush=True)
                _ckptio._fail_exit_status()
    except KeyboardInterrupt:
        for m in managers:
            m._m.abandon()
        print("ckptio: interrupted: saves in flight abandoned; the newest committed checkpoint is intact",
              file=sys.stderr, flush=True)


atexit.register(_close_all_at_exit)
