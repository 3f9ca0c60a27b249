"""torch.Tensors in and out of ckptio checkpoints (used by _tree and _manager
only when the caller's tree or target holds torch objects; torch is never
imported here on its own: sys.modules["torch"]).

Save: a CPU tensor reaches the C++ snapshot as a numpy view of its memory
(``Tensor.numpy()``: no copy; bfloat16 and float8 through a same-size integer
view and ml_dtypes), so the only copy is ckptio's into staging. Measured on a
1 GiB state of 100 float32 tensors: building the views and the tree costs
1 ms per save; the snapshot itself runs at the speed of a 2-thread memcpy. A
non-contiguous tensor (a transposed view, a slice with steps) is made
contiguous first: that one copy more is the only one. A CUDA tensor is copied
into pinned host memory of ckptio's own (DeviceStaging: allocated once per
manager, grown to the largest state seen, reused) on a stream of ckptio's own,
all copies started before the first is waited for; save() returns once they
are done and the snapshot of the host copies is taken.

A DTensor (FSDP2's ``fully_shard``, tensor parallelism) is saved as the chunk
this rank holds, with its box in the global tensor (as a sharded jax.Array
is); a chunk held by several ranks (replicated along a mesh dimension) is
written by the one at coordinate 0 of those dimensions.

Restore: every read goes straight into the destination tensor's memory where
it is a contiguous CPU tensor of the checkpoint's dtype (restore_slices with
a numpy view of the tensor as the buffer); anything else (another dtype,
another device, a non-contiguous view) is read into a host temporary and
copied with ``Tensor.copy_`` (the cast, the host-to-device copy).
"""
import collections
import datetime
import sys

import numpy as np

from . import _dtypes, _jax

# Safetensors name -> torch dtype attribute, for every dtype ckptio stores.
_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "F16": "float16",
    "BF16": "bfloat16", "U32": "uint32", "I32": "int32", "F32": "float32", "U64": "uint64",
    "I64": "int64", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}
# Torch dtypes numpy has no type of its own for: viewed as a same-size integer.
_VIEWS = {"BF16": "int16", "F8_E4M3": "uint8", "F8_E5M2": "uint8"}


def _torch():
    return sys.modules.get("torch")


def is_tensor(x):
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def is_dtensor(x):
    """A torch.distributed.tensor.DTensor (FSDP2's parameters and their state)."""
    if not is_tensor(x) or "torch.distributed.tensor" not in sys.modules:
        return False
    return isinstance(x, sys.modules["torch.distributed.tensor"].DTensor)


_tables = None


def _dtype_tables():
    """(torch dtype -> safetensors name, safetensors name -> torch dtype)."""
    global _tables
    if _tables is None:
        torch = _torch()
        by_name = {name: getattr(torch, attr) for name, attr in _TORCH_NAMES.items() if hasattr(torch, attr)}
        _tables = ({dtype: name for name, dtype in by_name.items()}, by_name)
    return _tables


def dtype_name(torch_dtype):
    """The safetensors name of a torch dtype, or None."""
    return _dtype_tables()[0].get(torch_dtype)


def torch_dtype(name):
    return _dtype_tables()[1][name]


def _supported():
    return ", ".join(str(d) for d in _dtype_tables()[1].values())


def check_storable(t, name):
    """Raises TypeError naming the leaf if tensor `t` cannot be stored."""
    torch = _torch()
    if t.layout != torch.strided:
        raise TypeError(f"cannot save {name!r}: a {t.layout} tensor (only dense, strided tensors are stored; "
                        "call .to_dense() first)")
    if t.is_quantized:
        raise TypeError(f"cannot save {name!r}: a quantized tensor ({t.dtype}); dequantize it first")
    if dtype_name(t.dtype) is None:
        raise TypeError(f"cannot save {name!r}: dtype {t.dtype} is not supported (supported: {_supported()})")
    if t.device.type == "meta":
        raise TypeError(f"cannot save {name!r}: a tensor on the meta device has no data")


def byte_view(t):
    """A 1-D uint8 numpy array over the memory of contiguous CPU tensor `t`
    (no copy): what restore_slices reads into."""
    torch = _torch()
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy()


def to_numpy(t, name, host=None):
    """A C-contiguous numpy view of tensor `t` for the snapshot: no copy for a
    contiguous CPU tensor. `host`: id(tensor) -> its host copy
    (DeviceStaging.copy) for tensors on another device."""
    torch = _torch()
    check_storable(t, name)
    t = t.detach()
    if t.device.type != "cpu":
        copied = host.get(id(t)) if host is not None else None
        t = copied if copied is not None else t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()  # the one copy ckptio makes itself
    if t.is_neg():
        t = t.resolve_neg()
    stored = dtype_name(t.dtype)
    if stored in _VIEWS:
        return t.view(getattr(torch, _VIEWS[stored])).numpy().view(_dtypes.numpy_dtype(stored))
    return t.numpy()


def from_numpy(array):
    """The torch tensor over numpy `array`'s memory (no copy), of the torch
    dtype of its safetensors dtype."""
    torch = _torch()
    stored = _dtypes.dtype_name(array.dtype)
    if stored in _VIEWS:
        return torch.from_numpy(array.view(np.dtype(_VIEWS[stored]))).view(torch_dtype(stored))
    if not array.flags.writeable:
        array = array.copy()  # torch tensors are writable; never hand out one over read-only memory
    return torch.from_numpy(array)


def snapshot_check(watched, step):
    """A save's snapshot check (run once its copy is taken): raises naming the
    tensors of `watched` ((name, tensor) pairs) that changed in place since
    this call, from their version counters. What makes snapshot "background"
    safe to get wrong: a tensor changed during its copy fails the save,
    never commits a torn one. (A change through ``.data`` or a numpy view
    bumps no counter: not seen.)"""
    versions = [t._version for _, t in watched]

    def check():
        changed = [name for (name, t), v in zip(watched, versions) if t._version != v]
        if changed:
            shown = ", ".join(repr(n) for n in changed[:3])
            if len(changed) > 3:
                shown += f" and {len(changed) - 3} more"
            raise RuntimeError(
                f"step {step} is not saved: {shown} changed in place while the snapshot was being copied "
                "(snapshot=\"background\": change saved tensors only after manager.wait_snapshots(), "
                "e.g. ckptio.torch.wait_before_step(manager, optimizer))")
    return check


def wait_before_step(manager, optimizer):
    """Makes ``optimizer.step()`` wait for the copies of ``manager``'s saves
    (snapshot "background"): the copy then overlaps the forward and backward
    passes, which read the parameters but do not change them. Returns the
    hook's handle (``.remove()``)."""
    return optimizer.register_step_pre_hook(lambda *_: manager.wait_snapshots())


# --- CUDA (any non-CPU device): copies into pinned host memory -----------------


class DeviceStaging:
    """Pinned host memory that the tensors of a save living on an accelerator
    are copied into, on a stream of ckptio's own, before the C++ snapshot
    copies them into staging. Allocated once (grown to the largest save's
    device bytes) and reused by every save of its manager: the snapshot has
    copied out of it by the time save() returns, so the next save may
    overwrite it. Not thread-safe: one save at a time (save() is)."""

    def __init__(self):
        self._buffer = None  # a pinned uint8 torch tensor
        self._streams = {}   # device -> torch.cuda.Stream

    @property
    def in_use(self):
        """Some save copied into the buffer (a background snapshot may read it)."""
        return self._buffer is not None

    def copy(self, tensors):
        """{id(t): host tensor} for every tensor of `tensors` on a CUDA device;
        returns once every copy is done."""
        torch = _torch()
        device_tensors = [t for t in tensors if is_tensor(t) and t.device.type == "cuda"]
        if not device_tensors:
            return {}
        sizes = [(t.numel() * t.element_size() + 63) // 64 * 64 for t in device_tensors]
        total = sum(sizes)
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = None
            self._buffer = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        out, offset, used = {}, 0, set()
        for t, size in zip(device_tensors, sizes):
            stream = self._stream(t.device)
            # The copy must see every write the trainer queued on its own stream.
            stream.wait_stream(torch.cuda.current_stream(t.device))
            nbytes = t.numel() * t.element_size()
            host = self._buffer[offset:offset + nbytes].view(t.dtype).view(t.shape) if nbytes else \
                torch.empty(t.shape, dtype=t.dtype)
            with torch.cuda.stream(stream):
                source = t.detach()
                host.copy_(source if source.is_contiguous() else source.contiguous(), non_blocking=True)
                source.record_stream(stream)  # the caller's allocator must not reuse it before the copy
            out[id(t)] = host
            used.add(t.device)
            offset += size
        for device in used:
            self._streams[device].synchronize()
        return out

    def _stream(self, device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = _torch().cuda.Stream(device)
        return stream


# --- DTensor: the chunk of each rank -------------------------------------------


def dtensor_box(t):
    """(start, shape) of the part of the global tensor DTensor `t` holds on
    this rank, or None if this rank is outside its mesh."""
    if t.device_mesh.get_coordinate() is None:
        return None
    chunks = t.__create_chunk_list__()
    if len(chunks) != 1:
        raise NotImplementedError(f"a DTensor with {len(chunks)} local chunks")
    return tuple(int(n) for n in chunks[0].offsets), tuple(int(n) for n in chunks[0].sizes)


def dtensor_chunks(t, name):
    """[(start, local tensor)] if this rank writes the chunk of DTensor `t` it
    holds, else []: of the ranks holding the same chunk (along the mesh
    dimensions it is replicated over) the one at coordinate 0 writes it."""
    coordinate = t.device_mesh.get_coordinate()
    if coordinate is None:
        return []
    for dim, placement in enumerate(t.placements):
        if placement.is_partial():
            raise TypeError(f"cannot save {name!r}: a DTensor with a Partial placement (pending reduction) "
                            "on mesh dimension {dim}; call .redistribute() to Shard or Replicate first")
        if placement.is_replicate() and coordinate[dim] != 0:
            return []
    start, shape = dtensor_box(t)
    if 0 in shape:
        return []  # an uneven split left this rank nothing
    local = t.to_local()
    if tuple(local.shape) != shape:
        raise ValueError(f"cannot save {name!r}: the DTensor's local tensor has shape {tuple(local.shape)}, "
                         f"its chunk {shape}")
    return [(start, local)]


# --- restore ----------------------------------------------------------------------


def _aligned_tensor(shape, stored):
    """A new CPU tensor of `shape` and safetensors dtype `stored` whose memory
    starts page-aligned, on 4 KiB pages (as _jax's restore buffers: O_DIRECT
    reads land in it directly, and populate it ahead of themselves)."""
    return from_numpy(_jax._aligned_empty(tuple(shape), _dtypes.numpy_dtype(stored)))


class Reads:
    """Reads of boxes of a checkpoint's arrays into tensors (or numpy arrays),
    run together by one restore_slices call per batch. A box part that is
    contiguous both in its chunk and in a destination that is a contiguous CPU
    tensor of the stored dtype is read straight into it; rows of at least
    1 KiB likewise, row by row; anything else is read into a host temporary
    (the whole chunk when its part is scattered) and copied in after the
    batch (Tensor.copy_ casts and crosses devices)."""

    def __init__(self, m, step, catalog, limit=256 << 20):
        self.m, self.step, self.catalog, self.limit = m, step, catalog, limit
        self.slices, self.after, self.temps, self.batch_bytes = [], [], {}, 0

    def into(self, name, start, dest, done=None):
        """Queues the reads that fill `dest` (a tensor, or a numpy array) with
        the box of array `name` starting at `start` of dest's shape; `done()`
        runs once it is filled."""
        stored, global_shape, chunk_list = self.catalog.arrays[name]
        shape = tuple(dest.shape)
        if len(start) != len(global_shape) or any(
                s < 0 or s + n > g for s, n, g in zip(start, shape, global_shape)):
            raise ValueError(f"tensor {name!r}: box at {tuple(start)} of shape {shape} is outside the "
                             f"checkpoint's shape {global_shape}")
        dtype = _dtypes.numpy_dtype(stored)
        if is_tensor(dest):
            dest = dest.detach()  # the same memory; a parameter's grad mode does not matter
            direct = (dest.device.type == "cpu" and dest.dtype == torch_dtype(stored) and dest.is_contiguous()
                      and not dest.is_neg() and dest.numel() > 0)
            buf = dest if direct else _aligned_tensor(shape, stored)
            raw = byte_view(buf) if buf.numel() else np.empty(0, np.uint8)
            if not direct:
                self.batch_bytes += raw.nbytes
                self.after.append(lambda dest=dest, buf=buf: dest.copy_(buf))
        else:
            direct = dest.dtype == dtype and dest.flags.c_contiguous and dest.flags.writeable
            buf = dest if direct else np.empty(shape, dtype)
            raw = buf.reshape(-1).view(np.uint8)
            if not direct:
                self.batch_bytes += raw.nbytes
                self.after.append(lambda dest=dest, buf=buf: np.copyto(dest, buf, casting="unsafe"))
        if done is not None:
            self.after.append(done)
        if raw.nbytes:
            self._plan(name, tuple(start), shape, chunk_list, dtype.itemsize, raw)
        if self.batch_bytes >= self.limit:
            self.run()

    def _plan(self, name, start, shape, chunk_list, itemsize, raw):
        box = tuple((s, s + n) for s, n in zip(start, shape))
        plain = True  # every part read straight into place: the reads populate `raw`
        for tensor, cstart, cshape in chunk_list:
            ov = []
            for a in range(len(cshape)):
                lo, hi = max(cstart[a], box[a][0]), min(cstart[a] + cshape[a], box[a][1])
                if lo >= hi:
                    break
                ov.append((lo, hi))
            else:
                if not cshape:  # a scalar
                    self.slices.append((tensor, 0, raw))
                    continue
                in_chunk = tuple((lo - s, hi - s) for (lo, hi), s in zip(ov, cstart))
                in_out = tuple((lo - b[0], hi - b[0]) for (lo, hi), b in zip(ov, box))
                src = _jax._contiguous_rows(in_chunk, cshape)
                dst = _jax._contiguous_rows(in_out, shape)
                if src is not None and dst is not None:
                    self.slices.append((tensor, src[0] * itemsize,
                                        raw[dst[0] * itemsize:(dst[0] + dst[1]) * itemsize]))
                    continue
                strided = _jax._strided_rows(in_chunk, cshape, in_out, shape, itemsize)
                plain = False
                if strided is not None:
                    for src_off, dst_off, run, rows, stride, dst_stride in strided:
                        self.slices.append((tensor, src_off, raw[dst_off:], run, rows, stride, dst_stride))
                    continue
                temp = self.temps.get(tensor)
                if temp is None:
                    n = int(np.prod(cshape, dtype=np.int64)) * itemsize
                    temp = self.temps[tensor] = np.empty(n, np.uint8)
                    self.slices.append((tensor, 0, temp))
                    self.batch_bytes += n
                self.after.insert(0, lambda t=temp, r=raw, ic=in_chunk, io=in_out, cs=cshape, s=shape, k=itemsize:
                                  _copy_box(t, cs, ic, r, s, io, k))
        if not plain:
            _jax._populate_soon(raw)

    def run(self):
        if self.slices:
            self.m.restore_slices(self.step, self.slices)
        after = self.after
        self.slices, self.after, self.temps, self.batch_bytes = [], [], {}, 0
        for fn in after:
            fn()


def _copy_box(temp, cshape, in_chunk, raw, shape, in_out, itemsize):
    """Copies box `in_chunk` of a chunk (bytes in `temp`) to box `in_out` of
    the destination (bytes in `raw`)."""
    src = temp.view(f"V{itemsize}").reshape(cshape)
    dst = raw.view(f"V{itemsize}").reshape(shape)
    dst[tuple(slice(lo, hi) for lo, hi in in_out)] = src[tuple(slice(lo, hi) for lo, hi in in_chunk)]


def check_shape(name, target_shape, stored_shape):
    if tuple(target_shape) != tuple(stored_shape):
        raise ValueError(f"tensor {name!r}: the checkpoint has shape {tuple(stored_shape)}, "
                         f"the target {tuple(target_shape)}")


def plan_target(reads, name, target):
    """Queues the reads of array `name` for a torch target leaf; returns a
    function giving the restored tensor (of the target's dtype and device;
    a DTensor on the target's mesh and placements)."""
    torch = _torch()
    stored, global_shape, _ = reads.catalog.arrays[name]
    check_shape(name, target.shape, global_shape)
    if is_dtensor(target):
        box = dtensor_box(target)
        if box is None:
            raise ValueError(f"tensor {name!r}: this rank is outside the target DTensor's mesh")
        start, shape = box
        local = _aligned_tensor(shape, stored)
        reads.into(name, start, local)
        dtensor = sys.modules["torch.distributed.tensor"].DTensor

        def build():
            out = local.to(device=target.to_local().device, dtype=target.dtype)
            return dtensor.from_local(out, target.device_mesh, target.placements, run_check=False,
                                      shape=target.shape, stride=target.stride())
        return build
    out = _aligned_tensor(global_shape, stored)
    reads.into(name, (0,) * len(global_shape), out)
    return lambda: out.to(device=target.device, dtype=target.dtype) if (
        out.device != target.device or out.dtype != target.dtype) else out


def fill(reads, name, target):
    """Queues the reads that fill torch tensor (or DTensor) `target` in place."""
    stored, global_shape, _ = reads.catalog.arrays[name]
    check_shape(name, target.shape, global_shape)
    if is_dtensor(target):
        box = dtensor_box(target)
        if box is None:
            return
        start, shape = box
        if 0 in shape:
            return
        reads.into(name, start, target.to_local())
        return
    with _torch().no_grad():
        reads.into(name, (0,) * len(global_shape), target.detach())


# --- torch.distributed as the engine ----------------------------------------------

BARRIER_TIMEOUT = datetime.timedelta(minutes=30)


def distributed_defaults(root):
    """(rank, world size, barrier) from torch.distributed's default process
    group when one exists with more than one rank, else None.

    The barrier is a named barrier on a connection of ckptio's own to the
    group's store (Store.clone()): ckptio calls it on its barrier thread,
    while the trainer runs collectives on the group, so it must neither
    issue collectives (they would interleave with the trainer's) nor share
    the trainer's store connection."""
    torch = _torch()
    if torch is None:
        return None
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.get_world_size()
    if world <= 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    if hasattr(store, "clone"):
        store = store.clone()
    return (dist.get_rank(), world, StoreBarrier(store, world, f"ckptio/{root}/"),
            StoreAllGather(store, world, dist.get_rank()))


class StoreAllGather:
    """allgather(name, data) over the store: each rank sets its key under the
    name, meets the others at a StoreBarrier, and reads every rank's key. Its
    key of the exchange before is deleted then (every rank has read it: each
    is past that exchange). The names ckptio gives are the job's (each
    host's root is its own: the remote tier's URL qualifies them)."""

    def __init__(self, store, world, rank, timeout=BARRIER_TIMEOUT):
        self.store, self.world, self.rank = store, world, rank
        self.barrier = StoreBarrier(store, world, "ckptio/exchange/", timeout)
        self.last = None

    def __call__(self, name, data):
        prefix = f"ckptio/exchange-data/{name}/"
        key = f"{prefix}{self.rank}"
        self.store.set(key, bytes(data))
        self.barrier(name)
        parts = [bytes(self.store.get(f"{prefix}{r}")) for r in range(self.world)]
        if self.last is not None and self.last != key:
            try:
                self.store.delete_key(self.last)
            except (RuntimeError, NotImplementedError):  # a FileStore cannot delete
                pass
        self.last = key
        return parts


class StoreBarrier:
    """barrier(name): returns once every one of `world` processes has called
    it with that name. Each arrival increments a counter in the store; the
    last one sets a flag everyone waits for; the last to leave deletes the
    keys, so a name may be used again (a step saved again)."""

    def __init__(self, store, world, prefix, timeout=BARRIER_TIMEOUT):
        self.store, self.world, self.prefix, self.timeout = store, world, prefix, timeout

    def __call__(self, name):
        key = self.prefix + name
        if self.store.add(key, 1) == self.world:
            self.store.set(key + "/done", "1")
        self.store.wait([key + "/done"], self.timeout)
        if self.store.add(key + "/left", 1) == self.world:
            for k in (key, key + "/done", key + "/left"):
                try:
                    self.store.delete_key(k)
                except (RuntimeError, NotImplementedError):  # a FileStore cannot delete
                    pass


def walk(tree, path=()):
    """[(name, container, key, leaf), ...] of a target tree, named as
    _tree.flatten names them; container[key] is the leaf (None for the root
    leaf, or a leaf inside a tuple)."""
    from . import _tree

    out = []
    stack = [(tree, path, None, None)]
    while stack:
        node, path, parent, key = stack.pop()
        if isinstance(node, collections.abc.Mapping):
            stack.extend((v, path + (str(k),), node, k) for k, v in reversed(list(node.items())))
        elif _tree._is_namedtuple(node):
            stack.extend((getattr(node, f), path + (f,), None, None) for f in reversed(node._fields))
        elif isinstance(node, (list, tuple)):
            owner = node if isinstance(node, list) else None
            stack.extend((v, path + (str(i),), owner, i if owner is not None else None)
                         for i, v in reversed(list(enumerate(node))))
        elif node is not None and not isinstance(node, str):
            out.append((_tree._name(path), parent, key, node))
    return out
