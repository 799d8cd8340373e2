"""Reading a checkpoint's *.safetensors shards (bf16/fp32, or FP8 e4m3 + weight_scale_inv).

Every shard is opened (its header parsed) up front, so a corrupt or truncated file fails before
any weight is loaded, with an error naming the file. Tensors are read lazily by name; a missing
or mis-shaped tensor raises CheckpointError naming the tensor, the file and the expected shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from model.reference import fp8_dequantize

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPE = torch.float8_e4m3fn
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file or tensor is missing, unreadable or has the wrong shape; the message says which."""


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:  # safetensors raises its own error type for every kind of damage
        raise CheckpointError(f"{path}: not a readable safetensors file (corrupt or truncated?): {e}") from None


class Checkpoint:
    """The tensors of a checkpoint directory, by name."""

    def __init__(self, model_dir):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        index = self.dir / INDEX_FILE
        self._where: dict[str, Path] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                assert isinstance(weight_map, dict)
            except Exception as e:
                raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map' object): {e}") from None
            for name, file in weight_map.items():
                path = self.dir / file
                if not path.is_file():
                    raise CheckpointError(f"{index} maps {name!r} to {file}, which does not exist in {self.dir}")
                self._where[name] = path
            files = sorted(set(self._where.values()))
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors shard in {self.dir}")
        self.files = files
        self._handles = {f: _open(f) for f in files}
        self._keys = {f: set(h.keys()) for f, h in self._handles.items()}
        self._index = index if index.is_file() else None
        for f, keys in self._keys.items():
            for name in keys:
                self._where.setdefault(name, f)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str, shape: tuple | None = None) -> torch.Tensor:
        """The tensor `name` as stored (dtype unchanged), checked against `shape` when given."""
        path = self._where.get(name)
        if path is None:
            shards = ", ".join(f.name for f in self.files)
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint in {self.dir} (shards: {shards})")
        if name not in self._keys[path]:
            raise CheckpointError(f"{self._index} maps tensor {name!r} to {path.name}, but that file has no such tensor")
        try:
            t = self._handles[path].get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} (corrupt shard or wrong index?): {e}") from None
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} in {path.name} has shape {tuple(t.shape)}, "
                                  f"expected {tuple(shape)} (from config.json)")
        return t

    def get_float(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        t = self.get(name, shape)
        if t.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {self._where[name].name} has dtype {t.dtype}, "
                                  f"expected fp32, bf16 or fp16")
        return t.to(device=device, dtype=dtype)

    def get_weight(self, prefix: str, shape: tuple[int, int], dtype: torch.dtype, device, *, block=(128, 128),
                   keep_fp8: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A linear layer's `prefix.weight` (out, in): (weight in `dtype`, None), or for an e4m3 weight
        with keep_fp8, (weight e4m3, weight_scale_inv fp32); without keep_fp8 it is dequantized here."""
        name = prefix + ".weight"
        w = self.get(name, shape)
        if w.dtype == FP8_DTYPE:
            grid = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
            scale = self.get(prefix + ".weight_scale_inv", grid)
            if scale.dtype not in FLOAT_DTYPES:
                raise CheckpointError(f"tensor {prefix + '.weight_scale_inv'!r} has dtype {scale.dtype}, expected a float dtype")
            if keep_fp8:
                return w.to(device), scale.to(device=device, dtype=torch.float32)
            return fp8_dequantize(w, scale, block, torch.float32).to(device=device, dtype=dtype), None
        if w.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {name!r} in {self._where[name].name} has dtype {w.dtype}, "
                                  f"expected fp32, bf16, fp16 or float8_e4m3fn (+ weight_scale_inv)")
        return w.to(device=device, dtype=dtype), None
