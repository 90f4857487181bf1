"""A safetensors file written as its tensors arrive: the header first, then each tensor's bytes.

Used by the Hugging Face export (`grpo_trainer.checkpoint.export`): a rank knows the names,
dtypes and shapes of what it will write before it has any of the data (they follow from the
model's metadata), so the header, which holds every tensor's byte range, goes out first and
each tensor is written, then dropped, as soon as it is at hand. Nothing but the tensor being
written is held, and the output may be any binary stream (a local file, or an S3 multipart
upload through fsspec). The format is safetensors' own: an 8-byte little-endian header length,
the JSON header padded with spaces to a multiple of 8 bytes, then the data; tensors are laid
out in the order given, which is all `safe_open` needs.
"""

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a file: what the header says before its bytes exist."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def header(specs: Sequence[TensorSpec], metadata: dict[str, str]) -> bytes:
    """The length prefix and JSON header of a file holding `specs` in this order."""
    doc: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for s in specs:
        if s.dtype not in DTYPES:
            raise ValueError(
                f"tensor {s.name}: dtype {s.dtype} has no safetensors name; export another dtype"
            )
        doc[s.name] = {
            "dtype": DTYPES[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return len(body).to_bytes(8, "little") + body


class StreamWriter:
    """Writes `specs` to `out` one tensor at a time, in order; refuses anything the header did not
    announce (a wrong name, shape or dtype would corrupt every offset after it)."""

    def __init__(self, out: BinaryIO, specs: Sequence[TensorSpec], metadata: dict[str, str]) -> None:
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("a safetensors file cannot hold a name twice")
        self.out, self.specs, self._next = out, list(specs), 0
        out.write(header(self.specs, metadata))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next == len(self.specs):
            raise ValueError(f"tensor {name}: the file's {len(self.specs)} announced tensors are all written")
        want = self.specs[self._next]
        got = TensorSpec(name, tuple(tensor.shape), tensor.dtype)
        if got != want:
            raise ValueError(f"safetensors stream expected {want}, got {got}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        self.out.write(flat.view(torch.uint8).numpy().data)  # the tensor's own bytes, not a copy
        self._next += 1

    def done(self) -> bool:
        """Whether every announced tensor has been written."""
        return self._next == len(self.specs)
