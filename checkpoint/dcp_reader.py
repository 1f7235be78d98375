"""DCP's fsspec reader, with the checkpoint's index (DCP's ``.metadata``, a pickle) decoded by
an unpickler that admits only what DCP writes there: its metadata dataclasses and enums,
torch's sizes, dtypes, layouts and memory formats, and a path. Anything else in the file (a function, a
class of another module: what a crafted pickle calls to run code) is refused before it is
looked up. Owns nothing else of DCP's reading; the tensors and values are read by DCP's planner
(``sharded._WeightsOnlyLoadPlanner``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import importlib
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

# the modules whose classes DCP's index holds (metadata, and the storage layout of its files)
_DCP_MODULES = frozenset({"torch.distributed.checkpoint.metadata",
                          "torch.distributed.checkpoint.filesystem",
                          "torch.distributed.checkpoint.planner"})
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
# the rest DCP's pickle names: a layout by its name, a local checkpoint's path (no I/O)
_PLAIN = {("torch.serialization", "_get_layout"): torch.serialization._get_layout,
          ("collections", "OrderedDict"): collections.OrderedDict,
          ("pathlib", "PosixPath"): pathlib.PosixPath,
          ("pathlib", "PurePosixPath"): pathlib.PurePosixPath}


class MetadataUnpickler(pickle.Unpickler):
    """Decodes DCP's ``.metadata``; raises ``pickle.UnpicklingError`` naming any other global."""

    def find_class(self, module: str, name: str) -> Any:
        found = _admitted(module, name)
        if found is None:
            raise pickle.UnpicklingError(
                f"DCP's .metadata names {module}.{name}, which is not part of DCP's metadata: "
                "the file was not written by torch.distributed.checkpoint (or was tampered "
                "with), and is not decoded.")
        return found


def _admitted(module: str, name: str) -> Any:
    if module in _DCP_MODULES:
        value = getattr(importlib.import_module(module), name, None)
        if isinstance(value, type) and (dataclasses.is_dataclass(value)
                                        or issubclass(value, enum.Enum)):
            return value
        return None
    if module == "torch":
        value = getattr(torch, name, None)
        return value if value is torch.Size or isinstance(value, _TORCH_VALUES) else None
    return _PLAIN.get((module, name))


class SafeMetadataReader(FsspecReader):
    """``FsspecReader`` whose ``read_metadata`` never runs code from the file."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"DCP's .metadata holds a {type(metadata).__name__}, "
                                         "not DCP's Metadata.")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
