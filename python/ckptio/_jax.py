"""Sharded jax.Arrays: chunks on save, any sharding on restore.

Save: a jax.Array spread over several devices (or processes) is stored as the
chunks this process holds, each with its box in the global array (the
manifest records them; format_version 2). Data held by several devices is
written once in total: the processes holding a replicated shard split it
among themselves along the first axis their number divides (replica-parallel),
else the first of them writes it whole.

Restore: each process reads, for every device of the target's sharding, only
the chunks that overlap that device's slice, with ranged reads, and builds the
array with jax.make_array_from_single_device_arrays. A checkpoint saved on one
mesh restores onto any other, and whole (numpy) tensors restore into sharded
targets and back.

jax is never imported here: it is used only when the caller's tree or target
already holds jax objects (sys.modules["jax"]).
"""
import concurrent.futures
import ctypes
import itertools
import sys

import numpy as np

from . import _dtypes


def _jax():
    return sys.modules.get("jax")


def is_jax_array(x):
    jax = _jax()
    return jax is not None and isinstance(x, jax.Array)


def is_sharded_target(x):
    """A target leaf that asks for a jax.Array: a jax.Array, or a
    ShapeDtypeStruct with a sharding."""
    jax = _jax()
    if jax is None:
        return False
    if isinstance(x, jax.Array):
        return True
    return isinstance(x, jax.ShapeDtypeStruct) and getattr(x, "sharding", None) is not None


def is_abstract(x):
    jax = _jax()
    return jax is not None and isinstance(x, jax.ShapeDtypeStruct)


def needs_chunks(x):
    """A jax.Array saved as chunks: one spread over several devices, or not
    fully addressable from this process."""
    if not is_jax_array(x):
        return False
    if not x.is_fully_addressable:
        return True  # a global array: this process holds part of it
    # Over several devices of this process: chunks, unless every device holds
    # all of it (np.asarray reads one replica, without gathering).
    return len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated


def _box(index, shape):
    """A tuple of slices (a device's index) -> ((start, stop), ...)."""
    return tuple(sl.indices(n)[:2] for sl, n in zip(index, shape))


# (sharding, shape, process, copies) -> _write_plan's answer
_plans = {}


def _write_plan(sharding, shape, process, copies=False):
    """[(start, device, local slices or None), ...]: the chunks of an array of
    this sharding and shape that `process` writes, each read from `device`'s
    shard (whole, or the slices of it). The processes holding a box split it
    along the first axis their number divides; if none does, the first
    writes it whole. With `copies`: instead, the chunks other processes write
    of the boxes `process` holds too (its local copies, two tiers)."""
    key = (sharding, shape, process, copies)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    holders = {}  # box -> devices holding it
    for device, index in sharding.devices_indices_map(shape).items():
        holders.setdefault(_box(index, shape), []).append(device)
    plan = []
    for box, devices in holders.items():
        processes = sorted({d.process_index for d in devices})
        if process not in processes:
            continue
        mine = min((d for d in devices if d.process_index == process), key=lambda d: d.id)
        extents = [stop - s for s, stop in box]
        count = len(processes)
        axis = None
        if count > 1:
            axis = next((a for a, e in enumerate(extents) if e > 0 and e % count == 0), None)
        # The writer of each piece of the box: process k of its holders the
        # k-th part along `axis`, or the first holder all of it.
        pieces = [(0, processes[0])] if axis is None else list(enumerate(processes))
        for k, writer in pieces:
            if (writer == process) == copies:
                continue
            start, local = [s for s, _ in box], None
            if axis is not None and count > 1:
                part = extents[axis] // count
                local = tuple(slice(k * part, (k + 1) * part) if a == axis else slice(None) for a in range(len(box)))
                start[axis] += k * part
            plan.append((tuple(start), mine, local))
    if len(_plans) > 4096:
        _plans.clear()
    _plans[key] = plan
    return plan


def start_host_copies(leaves):
    """Starts the device-to-host copies of every shard of every leaf at once,
    so that the transfers overlap (no-op for arrays already on the CPU)."""
    for x in leaves:
        if not is_jax_array(x):
            continue
        for shard in x.addressable_shards:
            if shard.device.platform != "cpu":
                shard.data.copy_to_host_async()


def chunks(x, process, copies=False):
    """[(start, numpy array), ...]: the chunks of jax.Array `x` this process
    writes (with `copies`: its local copies of the chunks other processes
    write of what it holds). The arrays are host views of the device buffers
    (no copy on the CPU) or slices of them."""
    by_device = {s.device: s for s in x.addressable_shards}
    out = []
    for start, device, local in _write_plan(x.sharding, tuple(x.shape), process, copies):
        data = np.asarray(by_device[device].data)
        out.append((start, data if local is None else data[local]))
    return out


# ---- restoring --------------------------------------------------------------


class Catalog:
    """A checkpoint's arrays, from its manifest: name -> (dtype name, global
    shape, [(tensor name, start, shape), ...]). A whole tensor is an array of
    one chunk at the origin."""

    def __init__(self, tensors):
        self.arrays = {}
        self.chunked = False
        for name, dtype, shape, chunk in tensors:
            if chunk is None:
                self.arrays[name] = (dtype, tuple(shape), [(name, (0,) * len(shape), tuple(shape))])
            else:
                self.chunked = True
                array, global_shape, start = chunk
                entry = self.arrays.setdefault(array, (dtype, tuple(global_shape), []))
                entry[2].append((name, tuple(start), tuple(shape)))

    def __contains__(self, name):
        return name in self.arrays


def _contiguous_rows(region, shape):
    """For a box `region` ((start, stop) per axis) inside an array of `shape`:
    (first element, elements) if its elements are one contiguous run in
    row-major order, else None."""
    rank = len(shape)
    k = 0  # axes before k have extent 1, axes after k span the whole array
    while k < rank and region[k][1] - region[k][0] == 1:
        k += 1
    if any(region[a] != (0, shape[a]) for a in range(k + 1, rank)):
        return None
    first, stride = 0, 1
    for a in reversed(range(rank)):
        first += region[a][0] * stride
        stride *= shape[a]
    count = 1
    for a in range(k, rank):
        count *= region[a][1] - region[a][0]
    return first, count


def _strided_rows(region, shape, out_region, out_shape, itemsize):
    """For a box of a chunk (`region` of `shape`) that lands in box
    `out_region` of an array of `out_shape`: [(chunk byte offset, out byte
    offset, run bytes, rows, chunk stride, out stride), ...], the box as runs
    of contiguous bytes in both (the axes after the runs' one span both whole),
    rows of them along the axis before, one such slice per index of the axes
    before that. None if the runs are short (many small reads), or the box is
    contiguous in both (one run: _contiguous_rows)."""
    rank = len(shape)
    k = rank - 1  # the runs span axes k.. (those after k whole in both)
    while k > 0 and region[k] == (0, shape[k]) and out_region[k] == (0, out_shape[k]):
        k -= 1
    if k == 0:
        return None
    strides, out_strides = [1] * rank, [1] * rank
    for a in reversed(range(rank - 1)):
        strides[a] = strides[a + 1] * shape[a + 1]
        out_strides[a] = out_strides[a + 1] * out_shape[a + 1]
    run = (region[k][1] - region[k][0]) * strides[k] * itemsize
    if run < _MIN_RUN:
        return None
    rows = region[k - 1][1] - region[k - 1][0]
    slices = []
    for outer in itertools.product(*(range(lo, hi) for lo, hi in region[:k - 1])):
        index = outer + tuple(lo for lo, _ in region[k - 1:])
        out_index = tuple(i - lo + olo for i, (lo, _), (olo, _) in zip(index, region, out_region))
        src = sum(i * st for i, st in zip(index, strides))
        dst = sum(i * st for i, st in zip(out_index, out_strides))
        slices.append((src * itemsize, dst * itemsize, run, rows, strides[k - 1] * itemsize,
                       out_strides[k - 1] * itemsize))
    return slices


# Below this many bytes per row, a box is read with its whole chunk into a
# temporary and copied out: each row of a strided read is a span of its own
# to copy out of the read buffers. At 1024, the 512-byte rows of a 1 GiB
# restore onto column strips (bench/sharded_bench.py, row "other") went
# through 256 MiB of temporaries: 445 MiB at peak beyond the host memory of
# the restored arrays. Read in place (the reader bounds its bookkeeping of
# short rows), 52-57 MiB, in the same time (0.9-1.2 s either way).
_MIN_RUN = 256
_ALIGN = 4096
_MADV_NOHUGEPAGE = 15
_MADV_POPULATE_WRITE = 23  # Linux 5.14
_POPULATE_WINDOW = 4 << 20


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL around the call
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise
    except (OSError, AttributeError):
        return None


_madvise = _madvise()


def _aligned_empty(shape, dtype):
    """An uninitialised array whose data starts on a 4 KiB boundary: jax takes
    such a host buffer over as a CPU device buffer without copying it
    (device_put(..., donate=True)), and O_DIRECT reads land in it directly.

    Its pages are 4 KiB ones, and left unpopulated: the reads that fill an
    array straight into place populate it ahead of themselves (two streams
    on the CPU pool, src/pipeline/reader.cc); an array filled otherwise (row
    by row, or by copies out of a chunk read whole) is given to
    _populate_soon. Restoring 8 GiB onto one CPU device in a new process
    (bench/restore_bench.py, row jax; interleaved runs) took 5.0-7.6 s with
    huge pages asked for (timed, and given up once they came cold) and each
    buffer populated here as well, one thread per buffer; 3.7-4.1 s so;
    4.0-9.6 s with huge pages asked for and populated by the reads alone.
    On this VM huge pages come from memory that the hypervisor has taken
    back (free page reporting) and are compacted on the fault itself
    (transparent_hugepage/defrag is madvise)."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    if _madvise is not None and nbytes >= _ALIGN:  # a hint: errors ignored
        # numpy itself asks for huge pages on large arrays.
        _madvise(raw.ctypes.data + skip, nbytes // _ALIGN * _ALIGN, _MADV_NOHUGEPAGE)
    return raw[skip:skip + nbytes].view(dtype).reshape(shape)


def _populate_soon(array):
    """Populates the pages of `array` (C-contiguous) on the populate pool,
    _POPULATE_WINDOW at a time in order, so that both of its threads work on
    one large array, and the copies or reads into it find its first pages
    ready (populating a page already written leaves its bytes alone). The
    tasks hold `array`."""
    if _madvise is None or array.nbytes < _ALIGN:
        return
    start = -(-array.ctypes.data // _ALIGN) * _ALIGN
    end = (array.ctypes.data + array.nbytes) // _ALIGN * _ALIGN
    pool = _populate_pool()
    for at in range(start, end, _POPULATE_WINDOW):
        pool.submit(_madvise, at, min(_POPULATE_WINDOW, end - at),
                    _MADV_POPULATE_WRITE).add_done_callback(lambda _, keep=array: None)


_pool = None


def _populate_pool():
    global _pool
    if _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ckptio-populate")
    return _pool


class Reads:
    """Byte-range reads of many boxes of many arrays, done together in one
    restore_slices call (parallel, ranged) per batch. A chunk part that is
    contiguous both in the chunk and in the destination is read straight into
    place, and so is one made of rows of at least _MIN_RUN bytes (a strided
    slice: restore_slices reads the rows of every slice of a chunk together,
    in file order, each into its place); otherwise the chunk is read once,
    whole, into a temporary that every destination box overlapping it copies
    from. Either way the chunk's
    CRC32C is checked (restore_slices also reads, and drops, the bytes of a
    chunk that no part of the batch covers). A
    batch is run once its buffers pass `limit` bytes (full()), and its arrays
    built then, so a restore holds about one batch (or one array's chunks)
    beyond its result. Buffers that are the result themselves (box(...,
    kept=True): numpy outputs, and jax.Arrays on CPU devices, which take their
    host buffers over) do not count: batching them would only stop the reads
    of one batch overlapping the page faults of the next. A 4 GiB restore onto
    one CPU device in 16 batches of one array took 1.5-1.6x the disk's read
    time (fresh processes, page cache dropped), where restore() onto numpy,
    one call, took 1.0-1.15x."""

    def __init__(self, catalog, limit=256 << 20):
        self.catalog = catalog
        self.limit = limit
        self.slices = []  # (tensor name, byte offset, buffer)
        self.copies = []  # (destination view, temp, temp slices)
        self.temps = {}   # tensor name -> the whole chunk, read once per batch
        self.batch_bytes = 0  # destination and temporary buffers of the batch
        self.scratch, self.scratch_used = None, 0  # where the batch's temporaries live

    def box(self, name, box, dtype, kept=False):
        """A numpy array of `dtype` that holds box `box` of array `name`
        once run() returns; `kept`: it is (or becomes) the result's own
        memory, not counted in the batch."""
        _, global_shape, chunk_list = self.catalog.arrays[name]
        out = _aligned_empty(tuple(stop - start for start, stop in box), dtype)
        if not kept:
            self.batch_bytes += out.nbytes
        itemsize = out.dtype.itemsize
        flat = out.reshape(-1)
        plain = True  # every part read straight into place: the reads populate `out`
        for tensor, start, shape in chunk_list:
            ov = []
            for a in range(len(shape)):
                lo, hi = max(start[a], box[a][0]), min(start[a] + shape[a], box[a][1])
                if lo >= hi:
                    break
                ov.append((lo, hi))
            else:
                if not shape and not box:  # a scalar
                    self.slices.append((tensor, 0, flat))
                    continue
                in_chunk = tuple((lo - s, hi - s) for (lo, hi), s in zip(ov, start))
                in_out = tuple((lo - b[0], hi - b[0]) for (lo, hi), b in zip(ov, box))
                src = _contiguous_rows(in_chunk, shape)
                dst = _contiguous_rows(in_out, out.shape)
                if src is not None and dst is not None:
                    self.slices.append((tensor, src[0] * itemsize, flat[dst[0]:dst[0] + dst[1]]))
                    continue
                strided = _strided_rows(in_chunk, shape, in_out, out.shape, itemsize)
                plain = False
                if strided is not None:  # each row straight into place
                    raw = flat.view(np.uint8)
                    for src_off, dst_off, run, rows, stride, dst_stride in strided:
                        self.slices.append((tensor, src_off, raw[dst_off:], run, rows, stride, dst_stride))
                    continue
                temp = self.temps.get(tensor)
                if temp is None:
                    temp = self.temps[tensor] = self._scratch(shape, dtype)
                    self.slices.append((tensor, 0, temp.reshape(-1)))
                    self.batch_bytes += temp.nbytes
                part = tuple(slice(lo, hi) for lo, hi in in_chunk)
                self.copies.append((out[tuple(slice(lo, hi) for lo, hi in in_out)], temp, part))
        if not plain:
            _populate_soon(out)
        return out

    def _scratch(self, shape, dtype):
        """A temporary for a whole chunk, carved from one buffer reused by
        every batch (fresh memory costs a page fault per 4 KiB on first touch,
        slower than the disk here); a chunk larger than it gets its own."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        start = -(-self.scratch_used // 64) * 64  # 64-byte aligned, as numpy aligns
        if start + nbytes > self.limit:
            return np.empty(shape, dtype=dtype)
        if self.scratch is None:
            self.scratch = _aligned_empty((self.limit,), np.uint8)
        self.scratch_used = start + nbytes
        return self.scratch[start:start + nbytes].view(dtype).reshape(shape)

    def full(self):
        return self.batch_bytes >= self.limit

    def run(self, manager, step):
        if self.slices:
            manager.restore_slices(step, self.slices)
        for dst, temp, part in self.copies:
            dst[...] = temp[part]
        self.slices, self.copies, self.temps, self.batch_bytes, self.scratch_used = [], [], {}, 0, 0


def check_target(name, target, dtype_name, global_shape):
    """Raises ValueError naming the tensor if the target's shape or dtype
    differs from the checkpoint's."""
    shape = tuple(getattr(target, "shape", ()))
    if shape != global_shape:
        raise ValueError(f"tensor {name!r}: the checkpoint has shape {global_shape}, the target {shape}")
    want = np.dtype(target.dtype)
    have = _dtypes.numpy_dtype(dtype_name)
    if want != have:
        raise ValueError(f"tensor {name!r}: the checkpoint has dtype {have}, the target {want}")


def plan_sharded(reads, name, target):
    """Queues the reads a sharded target leaf needs; returns a function that
    builds the jax.Array once they are done."""
    jax = _jax()
    dtype_name, global_shape, _ = reads.catalog.arrays[name]
    check_target(name, target, dtype_name, global_shape)
    sharding = target.sharding
    dtype = _dtypes.numpy_dtype(dtype_name)
    by_box = {}
    devices = []
    placed = sharding.addressable_devices_indices_map(global_shape)
    on_cpu = all(device.platform == "cpu" for device in placed)  # the host buffers become the arrays
    for device, index in placed.items():
        box = _box(index, global_shape)
        if box not in by_box:
            by_box[box] = reads.box(name, box, dtype, kept=on_cpu)
        devices.append((device, box))

    def build():
        # The host buffer becomes the device buffer on the CPU (no copy: it
        # is handed over, nothing else refers to it); other devices copy.
        last = {box: i for i, (_, box) in enumerate(devices)}
        arrays = [jax.device_put(by_box[box], device, donate=last[box] == i)
                  for i, (device, box) in enumerate(devices)]
        return jax.make_array_from_single_device_arrays(global_shape, sharding, arrays)

    return build


def plan_whole(reads, name, dtype=None):
    """Queues the reads of a whole array; returns a function giving it as numpy."""
    dtype_name, global_shape, _ = reads.catalog.arrays[name]
    out = reads.box(name, tuple((0, n) for n in global_shape), dtype or _dtypes.numpy_dtype(dtype_name), kept=True)
    return lambda: out


def distributed_defaults(root):
    """(process index, process count, barrier, allgather) from jax's
    distributed runtime when jax.distributed.initialize() made this a
    multi-process job, else None. The barrier is the coordination service's
    (the same one multihost_utils.sync_global_devices relies on), without a
    device computation; allgather goes through its key-value store."""
    if _jax() is None:
        return None
    try:
        from jax._src import distributed
    except ImportError:
        return None
    state = distributed.global_state
    client = getattr(state, "client", None)
    if client is None or (state.num_processes or 1) <= 1:
        return None

    def barrier(name):
        client.wait_at_barrier(f"ckptio:{root}:{name}", _BARRIER_MS)

    return state.process_id, state.num_processes, barrier, _KeyValueAllGather(client, state.process_id)


_BARRIER_MS = 30 * 60 * 1000


class _KeyValueAllGather:
    """allgather(name, data) over the coordination service's key-value store:
    each process sets its key under the name's directory, waits at the
    name's barrier, and reads the directory. Its key of the exchange before
    is deleted then (every process has read it: each is past that exchange),
    so the store holds one exchange's keys per process at most. The names
    ckptio gives are the job's (each host's root is its own: the remote
    tier's URL qualifies them)."""

    def __init__(self, client, index):
        self._client, self._index = client, index
        self._last = None

    def __call__(self, name, data):
        prefix = f"ckptio:exchange:{name}/"
        key = f"{prefix}{self._index:06d}"
        self._client.key_value_set_bytes(key, bytes(data), allow_overwrite=True)
        self._client.wait_at_barrier(f"ckptio:exchange:{name}", _BARRIER_MS)
        parts = sorted(self._client.key_value_dir_get_bytes(prefix))
        if self._last is not None and self._last != key:
            self._client.key_value_delete(self._last)
        self._last = key
        return [value for _, value in parts]
