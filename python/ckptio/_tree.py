"""Pytrees <-> the flat, named tensors of a checkpoint.

A tree is nested dicts (any Mapping), lists, tuples and namedtuples whose
leaves are numpy arrays, jax arrays (anything with ``__array__``), numpy
scalars and Python bool/int/float; ``None`` and strings may sit in the tree
too (they are kept in the description, not as tensors).

Names follow flax's state-dict convention: the path of keys joined by "/",
list and tuple positions as "0", "1", ... (``params/dense/kernel``,
``opt_state/0/mu/bias``); a tree that is a single leaf is named "value".
Dicts keep their insertion order.

Next to the tensors, ``flatten`` returns a JSON-able description of the
tree (stored in the checkpoint's metadata under TREE_KEY), from which
``unflatten`` rebuilds the same containers, key types, scalars, None and
strings. A checkpoint without it (written by C++ or the CLI) comes back as
nested dicts split on "/".
"""
import collections
import sys
from collections.abc import Mapping

import numpy as np

from . import _dtypes, _jax, _torch

TREE_KEY = "ckptio_tree"
USER_KEY = "user"
ROOT_NAME = "value"

# Leaf kinds: what a restored tensor becomes ("torch": a torch.Tensor).
_ARRAY, _SCALAR, _INT, _FLOAT, _BOOL, _TORCH = "array", "scalar", "int", "float", "bool", "torch"


def _is_namedtuple(x):
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _name(path):
    name = "/".join(path) if path else ROOT_NAME
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = next((p for p in path if not _encodable(p)), name)
        raise ValueError(f"cannot save the leaf at {name!r}: the key {bad!r} is not valid Unicode "
                         f"({e.reason} at position {e.start}); tensor names are stored as UTF-8") from None
    return name


def _encodable(text):
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _leaf_kind(value, name):
    """What a leaf is stored as (its description's "kind"), decided without
    converting it (a sharded jax.Array is never gathered to find it).
    Raises TypeError naming the leaf if it is neither an array nor a scalar."""
    if isinstance(value, bool):
        return _BOOL
    if isinstance(value, int):
        return _INT
    if isinstance(value, float):
        return _FLOAT
    if isinstance(value, np.generic):
        return _SCALAR
    if _torch.is_tensor(value):
        return _TORCH
    if isinstance(value, np.ndarray) or hasattr(value, "__array__"):
        return _ARRAY
    raise TypeError(
        f"cannot save {name!r}: {type(value).__module__}.{type(value).__qualname__} is neither "
        "an array nor a scalar (trees are dicts, lists, tuples and namedtuples of arrays, "
        "scalars, None and strings)")


_PYTHON_SCALARS = {_BOOL: np.bool_, _INT: np.int64, _FLOAT: np.float64}


def to_array(value, name, kind, host=None):
    """The C-contiguous numpy array of one leaf of `kind`; no copy when the
    leaf already is a C-contiguous array (or CPU tensor) of a supported dtype.
    `host`: the host copies of tensors on an accelerator (_torch.DeviceStaging)."""
    if kind in _PYTHON_SCALARS:
        try:
            return np.asarray(value, dtype=_PYTHON_SCALARS[kind])
        except OverflowError:
            raise OverflowError(f"cannot save {name!r}: Python int {value} does not fit in int64") from None
    if isinstance(value, np.ndarray):
        array = value
    elif _torch.is_tensor(value):
        array = _torch.to_numpy(value, name, host)
    else:
        array = np.asarray(value)  # a numpy scalar; a jax.Array: a host view on the CPU
    if _dtypes.dtype_name(array.dtype) is None:
        if array.dtype.byteorder not in "=|" and _dtypes.dtype_name(array.dtype.newbyteorder("=")):
            array = array.astype(array.dtype.newbyteorder("="))
        else:
            raise TypeError(f"cannot save {name!r}: dtype {array.dtype} is not supported "
                            f"(supported: {_dtypes.supported()})")
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)  # the one copy ckptio ever makes itself
    return array


def flatten(tree, process=0, process_count=1, device_staging=None, local_copies=False):
    """(names, dtype names, arrays, chunks, local, description, immutable, watched) of a tree.

    A jax.Array spread over devices becomes the chunks this process writes:
    chunks[i] = (array name, global shape, start), and names[i] is "" (the
    library names chunks); None for a whole tensor. When several processes
    save one tree of global arrays, the whole tensors (numpy arrays, scalars:
    the same on every process) are written by process 0 alone.

    `local_copies` (two tiers, several processes): also what this process
    holds that another one writes (the parts of replicated chunks, the whole
    tensors), with local[i] True: kept in this host's local tier only, so
    that a restore here reads nothing from the remote tier.

    `immutable`: every array of the save is immutable or ckptio's own, so the
    save may borrow them instead of copying: views of jax.Arrays (jax never
    writes a buffer in place while something outside references it: a
    donation is refused and the step writes a new buffer), and the arrays
    made here from scalars. The caller's numpy arrays and torch tensors are
    not.

    `watched`: (name, tensor) of every CPU torch tensor whose own memory the
    snapshot copies, for _torch.snapshot_check (their version counters tell
    whether they changed during the copy).

    A torch DTensor is saved as the chunk this rank holds (_torch.dtensor_chunks),
    like a sharded jax.Array; tensors on an accelerator are copied to the host
    first, all at once, through `device_staging` (a _torch.DeviceStaging)."""
    leaves = []
    description = _encode(tree, (), leaves)
    for name, value, _ in leaves:
        if _jax.is_jax_array(value) and value.is_deleted():
            raise ValueError(f"cannot save {name!r}: the jax.Array was deleted (donated to a jitted step, "
                             "or .delete()d) before the save")
    _jax.start_host_copies(value for _, value, _ in leaves)
    host = None
    if device_staging is not None and any(kind == _TORCH for _, _, kind in leaves):
        host = device_staging.copy([value for _, value, kind in leaves if kind == _TORCH])
    names, dtypes, arrays, chunks, local = [], [], [], [], []
    sharded = any(_jax.needs_chunks(value) or _torch.is_dtensor(value) for _, value, _ in leaves)
    immutable = True
    watched = []
    for name, value, kind in leaves:
        if _torch.is_dtensor(value):
            for start, data in _torch.dtensor_chunks(value, name):
                if data.device.type == "cpu":
                    watched.append((name, data))
                array = to_array(data, name, _TORCH, host)
                names.append("")
                dtypes.append(_dtypes.dtype_name(array.dtype))
                arrays.append(array)
                chunks.append((name, tuple(int(n) for n in value.shape), start))
                local.append(False)
            immutable = False
            continue
        if _jax.needs_chunks(value):
            global_shape = tuple(int(n) for n in value.shape)
            for copies in (False, True) if local_copies else (False,):
                for start, data in _jax.chunks(value, process, copies):
                    array = to_array(data, name, _ARRAY)
                    names.append("")
                    dtypes.append(_dtypes.dtype_name(array.dtype))
                    arrays.append(array)
                    chunks.append((name, global_shape, tuple(int(s) for s in start)))
                    local.append(copies)
            continue
        copy = sharded and process_count > 1 and process != 0
        if copy and not local_copies:
            continue
        array = to_array(value, name, kind, host)
        if kind == _TORCH and value.device.type == "cpu":
            watched.append((name, value))
        immutable = immutable and (kind not in (_ARRAY, _TORCH) or _jax.is_jax_array(value))
        names.append(name)
        dtypes.append(_dtypes.dtype_name(array.dtype))
        arrays.append(array)
        chunks.append(None)
        local.append(copy)
    return names, dtypes, arrays, chunks, local, description, immutable, watched


# The walkers are module functions taking their state as arguments, not
# closures: a recursive closure is a reference cycle, which would keep the
# arrays it saw (GBs of contiguous copies, or restored tensors) alive until
# the garbage collector runs.
def _encode(node, path, out):
    if node is None:
        return None
    if isinstance(node, str):
        return {"str": node}
    if isinstance(node, Mapping):
        items = []
        for key, value in node.items():
            stored = key if isinstance(key, (str, int)) and not isinstance(key, bool) else str(key)
            items.append([stored, _encode(value, path + (str(key),), out)])
        return {"dict": items}
    if _is_namedtuple(node):
        return {"namedtuple": type(node).__name__, "fields": list(node._fields),
                "values": [_encode(getattr(node, f), path + (f,), out) for f in node._fields]}
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        return {kind: [_encode(v, path + (str(i),), out) for i, v in enumerate(node)]}
    name = _name(path)
    kind = _leaf_kind(node, name)
    out.append((name, node, kind))
    return {"leaf": name, "kind": kind}


def _leaf_value(array, kind):
    if kind == _INT:
        return int(array)
    if kind == _FLOAT:
        return float(array)
    if kind == _BOOL:
        return bool(array)
    if kind == _SCALAR:
        return array[()]
    if kind == _TORCH and not _torch.is_tensor(array):
        return _torch_leaf(array)
    return array


def _torch_leaf(array):
    """A tensor saved from torch, restored without a target: a torch.Tensor
    over the array's memory (numpy if torch is not installed)."""
    try:
        import torch  # noqa: F401  (registers itself in sys.modules for _torch)
    except ImportError:
        return array
    return _torch.from_numpy(array)


_namedtuple_types = {}


def _namedtuple_type(name, fields):
    key = (name, tuple(fields))
    if key not in _namedtuple_types:
        _namedtuple_types[key] = collections.namedtuple(name, fields)
    return _namedtuple_types[key]


def unflatten(description, arrays):
    """The tree `description` describes, its leaves taken from `arrays`
    (name -> numpy array)."""
    return _decode(description, arrays)


def _decode(node, arrays):
    if node is None:
        return None
    if "leaf" in node:
        name = node["leaf"]
        if name not in arrays:
            raise ValueError(f"the checkpoint's tree names tensor {name!r}, which it does not hold")
        return _leaf_value(arrays[name], node.get("kind", _ARRAY))
    if "str" in node:
        return node["str"]
    if "dict" in node:
        return {key: _decode(value, arrays) for key, value in node["dict"]}
    if "list" in node:
        return [_decode(v, arrays) for v in node["list"]]
    if "tuple" in node:
        return tuple(_decode(v, arrays) for v in node["tuple"])
    if "namedtuple" in node:
        values = [_decode(v, arrays) for v in node["values"]]
        try:
            return _namedtuple_type(node["namedtuple"], node["fields"])(*values)
        except (TypeError, ValueError):
            return tuple(values)
    raise ValueError(f"unknown node in the checkpoint's tree: {sorted(node)}")


class _AsSaved:
    """A target leaf that restores as saved (an array as saved, a scalar as
    the Python or numpy scalar it was)."""

    def __repr__(self):
        return "AS_SAVED"


AS_SAVED = _AsSaved()
_PLACEHOLDERS = {_INT: 0, _FLOAT: 0.0, _BOOL: False, _SCALAR: np.float32(0)}


def skeleton(description):
    """A target shaped as the tree `description` describes, each leaf a
    placeholder that restores it as saved."""
    kinds = _leaf_kinds(description)
    return _decode(description, {name: _PLACEHOLDERS.get(kind, AS_SAVED) for name, kind in kinds.items()})


def nest(arrays):
    """Nested dicts from "/"-separated names (a checkpoint without a tree)."""
    root = {}
    for name, array in arrays.items():
        parts = name.split("/")
        node = root
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                node = None
                break
            node = child
        if node is None or parts[-1] in node:
            root[name] = array  # "a" and "a/b" both exist: keep the full name
        else:
            node[parts[-1]] = array
    return root


def leaf_names(description):
    """The tensor names a description refers to."""
    return set(_leaf_kinds(description))


def _leaf_kinds(description):
    """name -> kind of each tensor a description refers to."""
    kinds = {}
    stack = [description]
    while stack:
        node = stack.pop()
        if node is None or "str" in node:
            continue
        if "leaf" in node:
            kinds[node["leaf"]] = node.get("kind", _ARRAY)
        elif "dict" in node:
            stack.extend(value for _, value in node["dict"])
        elif "namedtuple" in node:
            stack.extend(node["values"])
        else:
            stack.extend(node.get("list", node.get("tuple", [])))
    return kinds


def _values_by_name(node, path=(), out=None):
    """name -> value of the None and string leaves of a description."""
    out = {} if out is None else out
    if node is None:
        out[_name(path)] = None
    elif "leaf" in node:
        pass
    elif "str" in node:
        out[_name(path)] = node["str"]
    elif "dict" in node:
        for key, value in node["dict"]:
            _values_by_name(value, path + (str(key),), out)
    elif "namedtuple" in node:
        for field, value in zip(node["fields"], node["values"]):
            _values_by_name(value, path + (field,), out)
    else:
        for i, value in enumerate(node.get("list", node.get("tuple", []))):
            _values_by_name(value, path + (str(i),), out)
    return out


def named_leaves(tree, path=(), out=None):
    """[(name, leaf), ...] of a target tree (names as flatten gives them)."""
    out = [] if out is None else out
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            named_leaves(value, path + (str(key),), out)
    elif _is_namedtuple(tree):
        for f in tree._fields:
            named_leaves(getattr(tree, f), path + (f,), out)
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            named_leaves(value, path + (str(i),), out)
    elif tree is not None and not isinstance(tree, str):
        out.append((_name(path), tree))
    return out


def has_torch_leaves(tree):
    """Whether a target holds torch tensors."""
    return "torch" in sys.modules and any(_torch.is_tensor(leaf) for _, leaf in named_leaves(tree))


def has_jax_leaves(tree):
    """Whether a target holds jax.Arrays or ShapeDtypeStructs."""
    return _jax._jax() is not None and any(_jax.is_sharded_target(leaf) or _jax.is_abstract(leaf)
                                           for _, leaf in named_leaves(tree))


def _like_leaf(target, array, name):
    if _torch.is_tensor(target):
        return _torch_like(target, array, name)
    if isinstance(target, (bool, int, float)) and not isinstance(target, np.generic):
        if array.shape != ():
            raise ValueError(f"tensor {name!r}: the target holds a scalar, the checkpoint shape {array.shape}")
        return type(target)(array)
    if isinstance(target, np.generic):
        return array[()]
    if _jax.is_abstract(target) and not _jax.is_sharded_target(target):
        _jax.check_target(name, target, _dtypes.dtype_name(array.dtype), array.shape)
    shape = getattr(target, "shape", None)
    if shape is not None and tuple(shape) != array.shape:
        raise ValueError(f"tensor {name!r}: the checkpoint has shape {array.shape}, "
                         f"the target {tuple(shape)}")
    return array


def _torch_like(target, value, name):
    """A restored leaf as a tensor of the target's dtype and device (a
    DTensor target: built already by _torch.plan_target)."""
    _torch.check_shape(name, target.shape, value.shape)
    if not _torch.is_tensor(value):
        value = _torch.from_numpy(value)
    if _torch.is_dtensor(target):
        return value
    if value.dtype != target.dtype or value.device != target.device:
        value = value.to(device=target.device, dtype=target.dtype)
    return value


def like(target, arrays, description):
    """The restored tree shaped like `target`: its containers, the
    checkpoint's values (numpy arrays; Python scalars where the target has
    them). Tensors the target does not mention are left out."""
    values = _values_by_name(description) if description is not None else {}
    missing = []
    result = _like(target, (), arrays, values, missing)
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"the checkpoint has no tensor for {len(missing)} leaf(s) of the target: {shown}")
    return result


def _like(node, path, arrays, values, missing):
    if isinstance(node, Mapping):
        d = {key: _like(value, path + (str(key),), arrays, values, missing) for key, value in node.items()}
        if type(node) is dict:
            return d
        try:
            return type(node)(d)
        except Exception:  # a Mapping that cannot be built from a dict
            return d
    if _is_namedtuple(node):
        return type(node)(*[_like(getattr(node, f), path + (f,), arrays, values, missing)
                            for f in node._fields])
    if isinstance(node, (list, tuple)):
        items = [_like(v, path + (str(i),), arrays, values, missing) for i, v in enumerate(node)]
        return items if isinstance(node, list) else tuple(items)
    name = _name(path)
    if name in arrays:
        return _like_leaf(node, arrays[name], name)
    if name in values:
        return values[name]
    if node is None or isinstance(node, str):
        return node
    missing.append(name)
    return node
