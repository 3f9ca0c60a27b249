"""ckptio as a torch.distributed.checkpoint (DCP) storage backend.

Layout: a DCP save is one ckptio checkpoint (a step) under the root, made by
every rank of the job together (torch.distributed gives ckptio the ranks and
its barrier; rank 0 commits). Each item DCP's plan gives a rank becomes one
tensor of it: a whole tensor under its fully qualified name, a DTensor's chunk
(FSDP2, tensor parallel) as a ckptio chunk of the array named by the fqn, with
its box in the global tensor; a non-tensor value (a step count, a learning
rate, an optimizer's param_groups) as the JSON text of the value in a uint8
tensor of that name, never a pickle (a value JSON cannot hold raises,
naming it). Rank 0 stores in the checkpoint's metadata which names are
values, the tensors' requires_grad and DCP's planner data (the flattened
names' paths in the nested state dict); the tensors' chunks are the
manifest's. So DCP's metadata is rebuilt from what the checkpoint holds, and
DCP's own resharding reads it back on any number of ranks: each reader
reads, for every item of its plan, only the byte ranges it needs (straight
into the destination tensor where it is contiguous on the CPU), every chunk
checked against its CRC32C.

Async: StorageWriter is DCP's AsyncStager too. ``dcp.async_save`` calls its
``stage()`` on the trainer's thread: a copy of the state's tensors into host
memory of its own (allocated once, grown to the largest state, reused: the
next stage() waits until the save that used it is done with it), on two
threads; DCP then plans and writes in its background thread, and ckptio
writes from those host copies without another copy (borrowed).
"""
import concurrent.futures
import io
import json
import math
import os
import threading

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _dtypes, _jax, _torch
from ._errors import NotFoundError
from ._manager import CheckpointManager, _check_step

META_KEY = "ckptio_dcp"
FORMAT = 1
_STAGING_KEY = "__ckptio_staging__"


def _step_of(checkpoint_id):
    """A DCP checkpoint_id as a ckptio step: an int, or a string of one."""
    if checkpoint_id is None:
        return None
    if isinstance(checkpoint_id, str) and checkpoint_id.strip().isdigit():
        checkpoint_id = int(checkpoint_id)
    if isinstance(checkpoint_id, os.PathLike) or isinstance(checkpoint_id, str):
        raise ValueError(f"ckptio's DCP storage takes the step as checkpoint_id (an int, e.g. "
                         f"checkpoint_id=step), got {checkpoint_id!r}; the root is the StorageWriter's")
    return _check_step(checkpoint_id)


# --- values: JSON, with the types JSON lacks tagged --------------------------------


def encode_value(value, fqn):
    """JSON-able form of a non-tensor value of a state dict (None, bool, int,
    float, str, and lists, tuples and dicts of them); TypeError naming `fqn`
    for anything else."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        items = [encode_value(v, fqn) for v in value]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict):
        for k in value:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"cannot save {fqn!r}: a dict key {k!r} of type {type(k).__name__} "
                                "(keys of stored values are str or int)")
        return {"dict": [[k, encode_value(v, fqn)] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        raise TypeError(f"cannot save {fqn!r}: a tensor inside a non-tensor value")
    raise TypeError(f"cannot save {fqn!r}: {type(value).__module__}.{type(value).__qualname__} is neither a "
                    "tensor nor a value ckptio stores (None, bool, int, float, str, and lists, tuples and "
                    "dicts of them); ckptio never pickles")


def decode_value(node):
    if isinstance(node, list):
        return [decode_value(v) for v in node]
    if isinstance(node, dict):
        if "tuple" in node:
            return tuple(decode_value(v) for v in node["tuple"])
        if "float" in node:
            return float(node["float"])
        return {k: decode_value(v) for k, v in node["dict"]}
    return node


def _encode_path(path):
    return [p if isinstance(p, int) else str(p) for p in path]


# --- async staging: host copies of the state ---------------------------------------


class _Lease:
    """One use of the staging memory, from stage() until its DCP save is done
    with it: write_data's end, or the end of the thread that ran the save
    (a save that failed before writing). DCP calls state_dict() of every
    Stateful entry at the start of the save, in the save's thread: that is
    how the lease learns its thread (it holds no state: {})."""

    def __init__(self):
        self.done = threading.Event()
        self.thread = None

    def claim(self):
        if self.thread is None:
            self.thread = threading.current_thread()

    def state_dict(self):
        self.claim()
        return {}

    def load_state_dict(self, state_dict):
        pass

    def wait(self):
        while not self.done.wait(0.05):
            if self.thread is not None and not self.thread.is_alive():
                return


class _Staging:
    """Host memory the tensors of an async save are copied into: one buffer,
    grown to the largest state staged, each tensor at a 4 KiB boundary (so
    O_DIRECT writes go out straight from it), pinned when the state has CUDA
    tensors. CPU copies run on two threads (numpy releases the GIL), cut in
    pieces of 16 MiB."""

    PIECE = 16 << 20

    def __init__(self, threads=2):
        self._buffer = None  # a uint8 torch tensor
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="ckptio-stage")

    def stage(self, state_dict):
        tensors = []
        _collect_tensors(state_dict, tensors)
        sizes = [(_local(t).numel() * _local(t).element_size() + 4095) // 4096 * 4096 for t in tensors]
        pinned = any(_local(t).device.type == "cuda" for t in tensors)
        total = sum(sizes)
        if (self._buffer is None or self._buffer.numel() < total
                or (pinned and not self._buffer.is_pinned())):
            self._buffer = None
            self._buffer = (torch.empty(total, dtype=torch.uint8, pin_memory=True) if pinned
                            else _torch.from_numpy(_jax._aligned_empty((max(total, 1),), np.uint8)))
        copies, pieces, offset = {}, [], 0
        for t, size in zip(tensors, sizes):
            local = _local(t).detach()
            _torch.check_storable(local, "a staged tensor")
            nbytes = local.numel() * local.element_size()
            host = self._buffer[offset:offset + nbytes].view(local.dtype).view(local.shape)
            if local.device.type == "cpu":
                src = local if local.is_contiguous() else local.contiguous()
                if nbytes:
                    s, d = _torch.byte_view(src), _torch.byte_view(host)
                    pieces.extend((d[i:i + self.PIECE], s[i:i + self.PIECE]) for i in range(0, nbytes, self.PIECE))
            else:
                host.copy_(local, non_blocking=True)
            copies[id(t)] = _like_staged(t, host)
            offset += size
        list(self._pool.map(lambda p: np.copyto(p[0], p[1]), pieces))
        if pinned:
            torch.cuda.synchronize()
        return _rebuild(state_dict, copies)


def _local(t):
    return t.to_local() if _torch.is_dtensor(t) else t


def _like_staged(t, host):
    if _torch.is_dtensor(t):
        return type(t).from_local(host, t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                  stride=t.stride())
    return host


def _collect_tensors(node, out):
    if isinstance(node, torch.Tensor):
        out.append(node)
    elif isinstance(node, dict):
        for v in node.values():
            _collect_tensors(v, out)
    elif isinstance(node, (list, tuple)):
        for v in node:
            _collect_tensors(v, out)


def _rebuild(node, copies):
    """`node` with its tensors replaced by their staged copies and its
    containers copied (the trainer may change its own afterwards)."""
    import copy

    if isinstance(node, torch.Tensor):
        return copies[id(node)]
    if isinstance(node, dict):
        return {k: _rebuild(v, copies) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(v, copies) for v in node]
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        return tuple(_rebuild(v, copies) for v in node)
    return copy.deepcopy(node)


# --- the writer ---------------------------------------------------------------------


class StorageWriter(dcp.StorageWriter):
    """DCP StorageWriter (and AsyncStager) over a ckptio root.

        writer = ckptio.torch.StorageWriter("gs://bucket/run7", keep=3)
        dcp.save(state_dict, storage_writer=writer, checkpoint_id=step)
        future = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=step)

    ``checkpoint_id`` is the step (an int); without one, the step after the
    last this writer saved (or after the latest committed one). ``options``
    are CheckpointManager's (``keep``, ``tiers``, ``staging_memory``, ...).
    Every rank of the process group makes one on the same root; ranks and
    barrier come from torch.distributed. ``dcp.save`` returns once the step
    is committed; ``async_save``'s future completes then."""

    _synchronize_after_execute = False

    def __init__(self, root, **options):
        super().__init__()
        self.root = os.fspath(root)
        # Saves borrow (the state's own tensors in dcp.save, the staged copies in
        # async_save): staging is needed only for O_DIRECT's unaligned ends.
        options.setdefault("staging_memory", "64MiB")
        self._options = options
        self._manager = None
        self._step = None
        self._last_step = None
        self._is_coordinator = True
        self._global = None
        self._staging = None
        self._lease = None
        self._device_staging = _torch.DeviceStaging()

    # DCP's AsyncStager protocol
    @property
    def should_synchronize_after_execute(self):
        return False

    def stage(self, state_dict):
        """The snapshot of an async_save: host copies of the tensors (and copies
        of the values); returns once they are taken."""
        if self._lease is not None:
            self._lease.wait()  # the previous async save is done with the staging memory
        if self._staging is None:
            self._staging = _Staging()
        staged = self._staging.stage(state_dict)
        self._lease = _Lease()
        staged[_STAGING_KEY] = self._lease
        return staged

    def synchronize_staging(self):
        pass

    def close(self):
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    @property
    def manager(self):
        """The CheckpointManager (opened at the first save)."""
        if self._manager is None:
            self._manager = CheckpointManager(self.root, **self._options)
        return self._manager

    def __getstate__(self):
        raise TypeError("ckptio's StorageWriter cannot be pickled (the process-based async checkpointer "
                        "is not supported: use the default AsyncCheckpointerType.THREAD)")

    def reset(self, checkpoint_id=None):
        self._step = _step_of(checkpoint_id)
        if self._lease is not None:
            self._lease.claim()

    def set_up_storage_writer(self, is_coordinator, *args, rank=None, use_collectives=True, **kwargs):
        if self._lease is not None:
            self._lease.claim()
        mgr = self.manager
        if not use_collectives and mgr._process[1] > 1:
            raise ValueError("ckptio's DCP storage needs use_collectives=True with more than one rank "
                             "(rank 0 commits what every rank wrote)")
        self._is_coordinator = is_coordinator
        if self._step is None:
            last = self._last_step if self._last_step is not None else mgr.latest_step()
            self._step = 0 if last is None else last + 1
        self._global = None

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        """On the coordinator: what rank 0 stores of DCP's metadata."""
        kinds, planner_data = {}, {}
        for plan in plans:
            if not plan.usable:
                raise NotImplementedError("ckptio's DCP storage does not support cached save plans "
                                          "(enable_plan_caching)")
            for item in plan.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    kinds[fqn] = {"value": True}
                else:
                    kinds[fqn] = {"requires_grad": bool(item.tensor_data.properties.requires_grad)}
            if isinstance(plan.planner_data, dict):
                planner_data.update(plan.planner_data)
        self._global = {"format": FORMAT, "items": kinds,
                        "planner_data": {k: _encode_path(v) for k, v in planner_data.items()}}
        return plans

    def write_data(self, plan, planner):
        try:
            results = self._write(plan, planner)
        finally:
            if self._lease is not None and self._lease.thread is threading.current_thread():
                self._lease.done.set()
        fut = Future()
        fut.set_result(results)
        return fut

    def _write(self, plan, planner):
        mgr = self.manager
        step = self._step
        items = [item for item in plan.items if item.index.fqn != _STAGING_KEY]
        tensors = [planner.resolve_data(item) for item in items if item.type != WriteItemType.BYTE_IO]
        host = self._device_staging.copy(tensors)
        names, dtypes, arrays, chunks, results = [], [], [], [], []
        for item in items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                value = planner.lookup_object(item.index) if hasattr(planner, "lookup_object") else \
                    torch.load(planner.resolve_data(item), weights_only=True)
                array = np.frombuffer(json.dumps(encode_value(value, fqn), allow_nan=False).encode(), np.uint8)
                chunk = None
            else:
                array = _torch.to_numpy(tensors.pop(0), fqn, host)
                td = item.tensor_data
                offsets, sizes, size = tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size)
                chunk = None if (item.type == WriteItemType.TENSOR or (not any(offsets) and sizes == size)) \
                    else (fqn, size, offsets)
                if chunk is not None and 0 in sizes:
                    results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data=None))
                    continue
            names.append("" if chunk else fqn)
            dtypes.append(_dtypes.dtype_name(array.dtype))
            arrays.append(array)
            chunks.append(chunk)
            results.append(WriteResult(index=item.index, size_in_bytes=array.nbytes, storage_data=None))
        meta = {META_KEY: self._global} if self._is_coordinator and self._global is not None else {}
        handle = mgr._m.save(step, names, dtypes, arrays, json.dumps(meta, separators=(",", ":")),
                             chunks if any(c is not None for c in chunks) else None, True)
        handle.wait()  # committed: every rank's handle ends after rank 0's commit
        self._last_step = step
        self._step = None
        return results

    def finish(self, metadata, results):
        """Nothing left to do: the step was committed by ckptio (every rank's
        write_data waited for it)."""

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return False  # never chosen by DCP on its own: pass storage_writer=


# --- the reader ---------------------------------------------------------------------


class StorageReader(dcp.StorageReader):
    """DCP StorageReader over a ckptio root (opened read-only: it reads
    beside a trainer that writes).

        dcp.load(state_dict, storage_reader=ckptio.torch.StorageReader(root), checkpoint_id=step)

    ``checkpoint_id``: the step; None: the latest committed step. Reads
    checkpoints written by StorageWriter, and ckptio checkpoints written
    otherwise (their tensor names as fqns)."""

    def __init__(self, root, **options):
        super().__init__()
        self.root = os.fspath(root)
        self._options = options
        self._manager = None
        self._step = None
        self._catalog = None
        self._values = set()

    @property
    def manager(self):
        if self._manager is None:
            self._manager = CheckpointManager(self.root, read_only=True, **self._options)
        return self._manager

    def close(self):
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    def reset(self, checkpoint_id=None):
        self._step = _step_of(checkpoint_id)

    def read_metadata(self, *args, **kwargs):
        mgr = self.manager
        step = self._step
        if step is None:
            step = mgr.latest_step()
            if step is None:
                raise NotFoundError(f"no committed checkpoint in {mgr.root}", "NotFound")
        self._step = step
        metadata_json, listed = mgr._m.tensors(step)
        self._catalog = catalog = _jax.Catalog(listed)
        try:
            stored = json.loads(metadata_json or "{}").get(META_KEY) or {}
        except (ValueError, AttributeError):
            stored = {}
        kinds = stored.get("items", {})
        self._values = {fqn for fqn, kind in kinds.items() if kind.get("value")}
        md = {}
        for fqn, (dtype, shape, chunk_list) in catalog.arrays.items():
            if fqn in self._values:
                md[fqn] = BytesStorageMetadata()
                continue
            props = TensorProperties(dtype=_torch.torch_dtype(dtype),
                                     requires_grad=bool(kinds.get(fqn, {}).get("requires_grad", False)))
            md[fqn] = TensorStorageMetadata(
                properties=props, size=torch.Size(shape),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(start), sizes=torch.Size(cshape))
                        for _, start, cshape in chunk_list])
        planner_data = {k: tuple(v) for k, v in stored.get("planner_data", {}).items()} or None
        return Metadata(state_dict_metadata=md, planner_data=planner_data)

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        if self._catalog is None:
            self.read_metadata()

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        mgr = self.manager
        reads = _torch.Reads(mgr._m, self._step, self._catalog)
        for item in plan.items:
            fqn = item.storage_index.fqn
            if fqn not in self._catalog:
                raise ValueError(f"checkpoint {self._step} in {mgr.root} has no tensor {fqn!r}")
            if item.type == LoadItemType.BYTE_IO:
                _, shape, _ = self._catalog.arrays[fqn]
                buf = np.empty(shape, np.uint8)
                reads.into(fqn, (0,) * len(shape), buf,
                           done=lambda item=item, buf=buf: planner.load_bytes(item, _value_bytes(buf)))
                continue
            dest = planner.resolve_tensor(item)
            start = tuple(int(o) + int(s) for o, s in zip(item.storage_index.offset, item.storage_offsets))
            reads.into(fqn, start, dest, done=lambda item=item, dest=dest: planner.commit_tensor(item, dest))
        reads.run()
        fut = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return False


def _value_bytes(buf):
    """A stored value, as DCP's load_bytes takes it: torch.save's bytes of
    the value decoded from its JSON (made here, from plain data)."""
    value = decode_value(json.loads(buf.tobytes().decode()))
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out
