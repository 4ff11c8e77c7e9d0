"""Step inputs as one flat byte message, for rank 0 to ship to the other ranks each step.

A message is a small int64 header followed by the raw bytes of every tensor. The header
walks the fields of the step's dataclasses (``StepInputs`` and the ``AttentionMetadata``
inside it) in declaration order: for a tensor its dtype and shape, for a scalar its value.
Both ends run the same code, so the field order is the schema, and a field added to
either dataclass travels without a change here. Nothing is pickled.

Layout: ``[op, header_len, header..., payload bytes]`` with ``op`` one of the ``OP_*``
codes; ``STOP`` and ``RESIZE_SWAP`` carry only their argument in the header.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import struct
import typing
from typing import Any

import numpy as np
import torch

OP_STEP = 1
OP_STOP = 2
OP_RESIZE_SWAP = 3

_ALIGN = 8  # every tensor's bytes start on an 8-byte boundary so that it can be viewed in place
_NONE, _TENSOR, _INT, _BOOL, _FLOAT = range(5)
_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
           torch.float32, torch.float16, torch.bfloat16, torch.float64]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


def encode_step(inputs: Any) -> bytearray:
    """``OP_STEP`` message of a (nested) dataclass of CPU tensors and scalars."""
    header: list[int] = []
    arrays: list[np.ndarray] = []
    _encode(inputs, header, arrays)
    head = _pack_header(OP_STEP, header)
    # NOTE: numpy copies, one thread each: the step's few kilobytes are not worth an
    # intra-op thread pool, whose wake-ups cost more than the copies on a busy host.
    message = bytearray(len(head) + sum(_padded(a.nbytes) for a in arrays))
    message[: len(head)] = head
    view = np.frombuffer(message, dtype=np.uint8)
    at = len(head)
    for a in arrays:
        view[at : at + a.nbytes] = a
        at += _padded(a.nbytes)
    return message


def encode_op(op: int, *args: int) -> bytes:
    """A control message (``OP_STOP``, ``OP_RESIZE_SWAP``) with integer arguments."""
    return _pack_header(op, list(args))


def decode_op(message: bytes | bytearray) -> tuple[int, list[int], int]:
    """``(op, header, payload_offset)`` of a message."""
    op, length = struct.unpack_from("<qq", message, 0)
    header = list(struct.unpack_from(f"<{length}q", message, 16))
    return op, header, 16 + 8 * length


def decode_step(cls: type, message: bytearray, device: torch.device) -> Any:
    """Rebuild the ``cls`` instance that ``encode_step`` packed, its tensors on ``device``
    (those marked ``on_host`` stay on the host)."""
    op, header, offset = decode_op(message)
    if op != OP_STEP:
        raise ValueError(f"expected a step message, got op {op}")
    host = torch.frombuffer(message, dtype=torch.uint8, offset=offset) if len(message) > offset else \
        torch.empty(0, dtype=torch.uint8)  # (payload bytes,)
    # NOTE: one copy of the whole payload to the device, every tensor a view of it; staged
    # through pinned memory so the copy does not wait for the work already queued (the
    # host-side copy in numpy: see encode_step).
    if device.type == "cpu":
        payloads = (host, host)
    else:
        staged = torch.empty(host.shape, dtype=torch.uint8, pin_memory=True)
        staged.numpy()[:] = np.frombuffer(message, dtype=np.uint8, offset=offset)
        payloads = (host, staged.to(device, non_blocking=True))
    cursor = [0, 0]  # (header position, payload byte position)
    return _decode(cls, header, payloads, cursor, device)


def _pack_header(op: int, header: list[int]) -> bytes:
    return struct.pack(f"<qq{len(header)}q", op, len(header), *header)


def _padded(nbytes: int) -> int:
    return nbytes + (-nbytes % _ALIGN)


def _encode(obj: Any, header: list[int], arrays: list[np.ndarray]) -> None:
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            _encode(value, header, arrays)
        elif value is None:
            header.append(_NONE)
        elif isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise ValueError(f"{field.name}: step tensors must be built on the host to ship, got {value.device}")
            flat = value.contiguous().view(-1).view(torch.uint8)  # (nbytes,)
            arrays.append(flat.numpy())
            header += [_TENSOR, _DTYPE_CODE[value.dtype], value.dim(), *value.shape]
        elif isinstance(value, bool):
            header += [_BOOL, int(value)]
        elif isinstance(value, int):
            header += [_INT, value]
        elif isinstance(value, float):
            header += [_FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]]
        else:
            raise TypeError(f"{field.name}: cannot ship a {type(value).__name__} between ranks")


def _decode(cls: type, header: list[int], payloads: tuple[torch.Tensor, torch.Tensor], cursor: list[int],
            device: torch.device) -> Any:
    values = {}
    for name, nested, on_host in _schema(cls):
        if nested is not None:
            values[name] = _decode(nested, header, payloads, cursor, device)
            continue
        kind = header[cursor[0]]
        if kind == _TENSOR:
            dtype, ndim = _DTYPES[header[cursor[0] + 1]], header[cursor[0] + 2]
            shape = header[cursor[0] + 3: cursor[0] + 3 + ndim]
            cursor[0] += 3 + ndim
            nbytes = math.prod(shape) * dtype.itemsize
            raw = payloads[0 if on_host else 1][cursor[1]: cursor[1] + nbytes]  # (nbytes,) uint8
            cursor[1] += nbytes + (-nbytes % _ALIGN)
            values[name] = raw.view(dtype).view(shape)
        elif kind == _NONE:
            cursor[0] += 1
            values[name] = None
        else:
            raw_value = header[cursor[0] + 1]
            cursor[0] += 2
            if kind == _BOOL:
                raw_value = bool(raw_value)
            elif kind == _FLOAT:
                raw_value = struct.unpack("<d", struct.pack("<q", raw_value))[0]
            values[name] = raw_value
    return cls(**values)


@functools.cache
def _schema(cls: type) -> tuple[tuple[str, type | None, bool], ...]:
    """``cls``'s fields in order: name, the dataclass type when it nests one, and whether
    the field stays on the host (``metadata={"on_host": True}``)."""
    hints = typing.get_type_hints(cls)
    schema = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        nested = hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None
        schema.append((f.name, nested, bool(f.metadata.get("on_host", False))))
    return tuple(schema)
