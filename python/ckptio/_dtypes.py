"""numpy dtypes <-> the safetensors dtype names ckptio stores.

bfloat16 and the float8 types come from ml_dtypes (what JAX uses: a jax
bfloat16 array converts to a numpy array of ml_dtypes.bfloat16).
"""
import ml_dtypes
import numpy as np

# Safetensors name -> numpy dtype, for every dtype ckptio stores.
NUMPY_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "F32": np.dtype(np.float32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}

_NAMES = {dtype: name for name, dtype in NUMPY_DTYPES.items()}


def dtype_name(dtype):
    """The safetensors name of a numpy dtype (native byte order), or None."""
    return _NAMES.get(np.dtype(dtype))


def supported():
    """The numpy dtypes ckptio can store, by name, for error messages."""
    return ", ".join(str(d) for d in NUMPY_DTYPES.values())
