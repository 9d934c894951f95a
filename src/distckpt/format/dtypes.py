"""Dtype names used on disk: torch names in the index, safetensors codes in data files."""

from __future__ import annotations

import torch

from ..errors import CheckpointingException, CorruptCheckpointError

# torch dtype -> (index name, safetensors code)
_DTYPES: dict[torch.dtype, tuple[str, str]] = {
    torch.bool: ("bool", "BOOL"),
    torch.uint8: ("uint8", "U8"),
    torch.int8: ("int8", "I8"),
    torch.int16: ("int16", "I16"),
    torch.int32: ("int32", "I32"),
    torch.int64: ("int64", "I64"),
    torch.float16: ("float16", "F16"),
    torch.bfloat16: ("bfloat16", "BF16"),
    torch.float32: ("float32", "F32"),
    torch.float64: ("float64", "F64"),
    torch.complex64: ("complex64", "C64"),
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = (_name, _code)

_BY_NAME = {name: dtype for dtype, (name, _) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPES[dtype][0]
    except KeyError:
        raise CheckpointingException(
            f"dtype {dtype} cannot be saved; supported: {', '.join(sorted(_BY_NAME))}"
        ) from None


def safetensors_code(dtype: torch.dtype) -> str:
    dtype_name(dtype)
    return _DTYPES[dtype][1]


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in checkpoint index") from None


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
