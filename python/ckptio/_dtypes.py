"""numpy dtypes <-> the safetensors dtype names ckptio stores.

bfloat16 and the float8 types come from ml_dtypes (what JAX uses: a jax
bfloat16 array converts to a numpy array of ml_dtypes.bfloat16). ml_dtypes is
imported when first needed, not with ckptio: its import costs 0.8-1.0 s of CPU
(ml_dtypes 0.7, measured), a quarter of the time from `pip install` of the wheel
to a first save of float32 arrays. A save can only meet a bfloat16 or float8
array once something imported ml_dtypes; a restore loads it only for a
checkpoint that holds one of its types (numpy_dtype, table): in a fresh process
after a reboot, that import read its shared objects from a cold disk and took
1.1 s, longer than the 0.78 s read of a 1 GiB float32 state that asked for it.
"""
import sys

import numpy as np

# The types numpy has itself; those of ml_dtypes (name, attribute) go in after `after`.
_NUMPY = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "F16": np.dtype(np.float16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "F32": np.dtype(np.float32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F64": np.dtype(np.float64),
}
_ML_DTYPES = (("BF16", "bfloat16", "F16"), ("F8_E4M3", "float8_e4m3fn", None), ("F8_E5M2", "float8_e5m2", None))

_names = {dtype: name for name, dtype in _NUMPY.items()}
_all = None


def _numpy_dtypes():
    """Safetensors name -> numpy dtype, for every dtype ckptio stores (imports ml_dtypes)."""
    global _all
    if _all is None:
        import ml_dtypes

        extra = {name: np.dtype(getattr(ml_dtypes, attr)) for name, attr, _ in _ML_DTYPES}
        ordered = {}
        for name, dtype in _NUMPY.items():
            ordered[name] = dtype
            ordered.update({n: extra[n] for n, _, after in _ML_DTYPES if after == name})
        ordered.update({n: extra[n] for n, _, after in _ML_DTYPES if after is None})
        _names.update({dtype: name for name, dtype in extra.items()})
        _all = ordered
    return _all


def numpy_dtype(name):
    """The numpy dtype of a safetensors name (KeyError if none); imports ml_dtypes only for its own types."""
    dtype = _NUMPY.get(name)
    return dtype if dtype is not None else _numpy_dtypes()[name]


def table(names):
    """Safetensors name -> numpy dtype for those of `names` that have one; ml_dtypes imported only if needed."""
    out = {}
    for name in names:
        if name in _NUMPY:
            out[name] = _NUMPY[name]
        elif any(name == n for n, _, _ in _ML_DTYPES):
            out[name] = _numpy_dtypes()[name]
    return out


def __getattr__(name):
    # NUMPY_DTYPES: the whole table, as a module attribute (PEP 562), built on first use.
    if name == "NUMPY_DTYPES":
        return _numpy_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype):
    """The safetensors name of a numpy dtype (native byte order), or None."""
    dtype = np.dtype(dtype)
    name = _names.get(dtype)
    if name is None and _all is None and "ml_dtypes" in sys.modules:
        _numpy_dtypes()  # a bfloat16 or float8 dtype exists only once ml_dtypes is imported
        name = _names.get(dtype)
    return name


def supported():
    """The numpy dtypes ckptio can store, by name, for error messages."""
    return ", ".join(str(d) for d in _numpy_dtypes().values())
