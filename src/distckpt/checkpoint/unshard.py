"""Single-process readers: unshard a checkpoint into plain files, load single keys, inspect.

All of them read only the bytes they need, one tensor at a time: memory stays bounded by the
largest output file (the largest tensor when writing safetensors or one file per tensor).
"""

from __future__ import annotations

import enum
import os
import shutil
import sys
import time
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..cli import _human
from ..engine.checkpoint import CheckpointReader
from ..engine.io import tensor_bytes
from ..errors import CheckpointExistsError, MissingKeyError, UnsafeCheckpointError
from ..format.dtypes import dtype_from_name, safetensors_code
from ..format.safetensors import Entry, build_header
from ..mapping import ShardedObject, ShardedTensor
from ..serialization import _resolve_load_common, _resolve_load_sharded
from ..storage import Storage, storage_for
from .api import PATHS_KEY


class UnshardStrategyType(str, enum.Enum):
    """How :func:`unshard_checkpoint` lays out its output files."""

    #: one file for the model (and one for the optimizer): needs memory for the whole file
    #: with ``torch.save``; streamed tensor by tensor with safetensors.
    one_file = "one_file"
    #: one file per tensor, in ``model/`` (and ``optim/``).
    one_file_per_tensor = "one_file_per_tensor"
    #: tensors grouped into files of about ``chunk_size_bytes`` each.
    chunks = "chunks"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class UnshardStrategy:
    name: UnshardStrategyType = UnshardStrategyType.one_file
    chunk_size_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "name", UnshardStrategyType(self.name))
        if self.name == UnshardStrategyType.chunks:
            if not isinstance(self.chunk_size_bytes, int) or self.chunk_size_bytes <= 0:
                raise ValueError(f"the chunks strategy needs chunk_size_bytes > 0, got {self.chunk_size_bytes!r}")

    @classmethod
    def one_file(cls) -> "UnshardStrategy":
        return cls(UnshardStrategyType.one_file)

    @classmethod
    def one_file_per_tensor(cls) -> "UnshardStrategy":
        return cls(UnshardStrategyType.one_file_per_tensor)

    @classmethod
    def chunks(cls, chunk_size_in_bytes: int) -> "UnshardStrategy":
        return cls(UnshardStrategyType.chunks, chunk_size_in_bytes)


@dataclass(frozen=True)
class TensorMetadata:
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True)
class ObjectMetadata:
    nbytes: int


@dataclass(frozen=True)
class CheckpointInfo:
    """What :func:`get_checkpoint_metadata` returns: the commit record and every entry."""

    path: str
    save_id: str
    created: str
    writer: str
    world_size: int
    content_metadata: dict | None
    #: every saved entry by flat key (``model.<param>``, ``optim.state.<param>.<name>``, ...)
    state_dict_metadata: dict[str, TensorMetadata | ObjectMetadata]


class _Source:
    """One checkpoint opened for reading whole entries on this process."""

    def __init__(self, dir: "str | os.PathLike[str] | Storage", allow_pickle: bool = False) -> None:
        self.reader = CheckpointReader(dir)
        self.sharded = _resolve_load_sharded(None, self.reader.metadata)
        self.common_loader = _resolve_load_common(None, self.reader.metadata, allow_pickle)
        self.index = self.reader.index
        self.objects: dict[str, list[str]] = {}
        for unique_key in sorted(self.index.objects):
            self.objects.setdefault(unique_key.rpartition("/")[0], []).append(unique_key)
        try:
            common = self.common_loader.load_common(self.reader)
        except UnsafeCheckpointError:
            # e.g. a Megatron checkpoint with an argparse Namespace in its common state: only
            # the nested paths written by distckpt.checkpoint are needed here, and it has none.
            common = None
        self.paths: list[tuple] | None = (
            [tuple(p) for p in common[PATHS_KEY]] if isinstance(common, dict) and PATHS_KEY in common else None
        )

    def keys(self) -> list[str]:
        return sorted(set(self.index.tensors) | set(self.objects))

    def tensor_meta(self, key: str) -> tuple[tuple[int, ...], torch.dtype]:
        entry = self.index.tensors[key]
        return tuple(entry.shape), dtype_from_name(entry.dtype)

    def tensor_nbytes(self, key: str) -> int:
        return _nbytes(*self.tensor_meta(key))

    def read(self, key: str) -> Any:
        if key in self.index.tensors:
            shape, dtype = self.tensor_meta(key)
            request = ShardedTensor.from_global_offset(
                key, torch.empty(shape, dtype=dtype), shape, (0,) * len(shape)
            )
            self.sharded.load({key: request}, self.reader, self.common_loader)
            return request.data
        if key in self.objects:
            pieces = {}
            for unique_key in self.objects[key]:
                request_obj = ShardedObject.empty_from_unique_key(unique_key)
                value = self.sharded.load({key: request_obj}, self.reader, self.common_loader)[key]
                pieces[request_obj.global_offset] = value
            if len(pieces) == 1 and self.objects[key][0].endswith("/shard_0_1"):
                return next(iter(pieces.values()))
            return pieces  # a grid of objects (e.g. one per rank): {offset: value}
        raise MissingKeyError(f"{self.reader.path} has no entry {key!r}")


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for s in shape:
        count *= s
    return count * torch.empty((), dtype=dtype).element_size()


def get_checkpoint_metadata(dir: "str | os.PathLike[str] | Storage") -> CheckpointInfo:
    """The commit record and the key, shape and dtype of every entry (reads no data)."""
    reader = CheckpointReader(dir)
    meta = reader.metadata
    entries: dict[str, TensorMetadata | ObjectMetadata] = {}
    for key, tensor in reader.index.tensors.items():
        shape, dtype = tuple(tensor.shape), dtype_from_name(tensor.dtype)
        entries[key] = TensorMetadata(shape, dtype, _nbytes(shape, dtype))
    for unique_key, obj in reader.index.objects.items():
        entries[unique_key.rpartition("/")[0]] = ObjectMetadata(obj.nbytes)
    return CheckpointInfo(
        reader.path, meta.save_id, meta.created, meta.writer, meta.world_size,
        meta.content_metadata, dict(sorted(entries.items())),
    )


def load_keys(
    dir: "str | os.PathLike[str] | Storage",
    keys: Iterable[str],
    *,
    pre_download: bool = False,
    work_dir: str | os.PathLike[str] | None = None,
    allow_pickle: bool = False,
) -> Iterator[Any]:
    """The unsharded values of ``keys``, in order, loaded one at a time as the iterator is
    consumed (single process).

    A key is a saved entry (``"model.layers.0.weight"``) or a prefix of entries on nested-path
    boundaries (``"optim.state.layers.0.weight"`` gives that parameter's whole state dict).
    """
    _require_single_process("load_keys")
    source = _Source(storage_for(dir, pre_download=pre_download, work_dir=work_dir), allow_pickle)
    for key in list(keys):
        yield _load_key(source, key)


def _load_key(source: _Source, key: str) -> Any:
    if key in source.index.tensors or key in source.objects:
        return source.read(key)
    if source.paths is not None:
        below = [p for p in source.paths if ".".join(map(str, p)).startswith(key + ".")]
        for depth in range(1, max(map(len, below), default=0)):
            subtree = [p for p in below if ".".join(map(str, p[:depth])) == key]
            if subtree and len(subtree) == len(below):
                return _build(source, [(p[depth:], ".".join(map(str, p))) for p in subtree])
        if below:  # the prefix ends inside a path component (e.g. flattened optimizer keys)
            return {".".join(map(str, p))[len(key) + 1:]: source.read(".".join(map(str, p))) for p in below}
    raise MissingKeyError(
        f"{source.reader.path} has no entry {key!r} (see `distckpt inspect` for the saved keys)"
    )


def _build(source: _Source, entries: list[tuple[tuple, str]]) -> Any:
    """A nested container from ``(relative path, flat key)`` pairs, leaves read one by one."""
    root: dict = {}
    for path, key in entries:
        if not path:  # the entry is the whole subtree (e.g. an optimizer state saved as one value)
            return source.read(key)
        node: Any = root
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = source.read(key)
    return _lists(root)


def _lists(node: Any) -> Any:
    """Turn dicts keyed 0..n-1 by ints (saved lists) back into lists."""
    if not isinstance(node, dict):
        return node
    converted = {k: _lists(v) for k, v in node.items()}
    if converted and all(isinstance(k, int) for k in converted) and sorted(converted) == list(range(len(converted))):
        return [converted[i] for i in range(len(converted))]
    return converted


def unshard_checkpoint(
    dir: "str | os.PathLike[str] | Storage",
    target_dir: str | os.PathLike[str],
    *,
    optim: bool | None = None,
    save_overwrite: bool = False,
    use_safetensors: bool = False,
    unshard_strategy: UnshardStrategy | None = None,
    pre_download: bool = False,
    work_dir: str | os.PathLike[str] | None = None,
    quiet: bool = False,
) -> tuple[Path, Path | None]:
    """Write a :func:`save_model_and_optim_state` checkpoint as plain files (single process).

    Model tensors are keyed by parameter name, loadable with ``torch.load`` (or
    ``safetensors.torch.load_file`` with ``use_safetensors``). The optimizer state (default:
    included unless ``use_safetensors``) is ``{"state": {param: {...}}, "param_groups": [...]}``
    in one file, or with the per-tensor and chunked strategies its tensors in files keyed by
    ``state.<param>.<name>`` plus ``objects.pt`` with everything else.

    A checkpoint written with the Megatron-style :func:`distckpt.save` has no model/optimizer
    split: all its tensors go to the model output, keyed by their checkpoint keys.

    Returns:
        The model output and the optimizer output (None when not written): files for
        ``one_file``, directories otherwise.

    Raises:
        FileExistsError: ``target_dir`` is not empty and ``save_overwrite`` is False.
        ValueError: ``optim=True`` with ``use_safetensors=True`` (optimizer state holds
            Python values safetensors cannot store).
        RuntimeError: called in a distributed job with more than one rank.
    """
    _require_single_process("unshard_checkpoint")
    if "://" in os.fspath(target_dir) and not os.fspath(target_dir).startswith("file://"):
        raise ValueError(f"target_dir must be a local directory, not {os.fspath(target_dir)}")
    strategy = unshard_strategy or UnshardStrategy.one_file()
    if optim is None:
        optim = not use_safetensors
    if optim and use_safetensors:
        raise ValueError(
            "optim=True cannot be combined with use_safetensors=True: optimizer state holds "
            "Python values safetensors cannot store; pass optim=False or use_safetensors=False"
        )
    target = Path(target_dir)
    if target.exists() and any(target.iterdir()) and not save_overwrite:
        raise CheckpointExistsError(
            f"{target} is not empty; pass save_overwrite=True to replace its files"
        )
    target.mkdir(parents=True, exist_ok=True)
    for previous in ("model.pt", "model.safetensors", "optim.pt", "model", "optim"):
        # outputs of an earlier unshard into this directory must not mix with the new ones
        old = target / previous
        if old.is_dir():
            shutil.rmtree(old)
        elif old.exists():
            old.unlink()
    source = _Source(storage_for(dir, pre_download=pre_download, work_dir=work_dir))
    model_keys, optim_entries = _split(source)
    if optim and not optim_entries:
        optim = False  # nothing to write (the checkpoint holds no optimizer state)
    total = sum(source.tensor_nbytes(k) for k, _ in model_keys)
    if optim:
        total += sum(source.tensor_nbytes(k) for k, _ in optim_entries if k in source.index.tensors)
    progress = _Progress(total, quiet)
    suffix = ".safetensors" if use_safetensors else ".pt"
    try:
        if strategy.name == UnshardStrategyType.one_file:
            model_out = target / f"model{suffix}"
            if use_safetensors:
                _stream_safetensors(source, model_keys, model_out, progress)
            else:
                _save_pt(source, model_keys, model_out, progress)
            optim_out = None
            if optim:
                optim_out = target / "optim.pt"
                _atomic_torch_save(_build_with_progress(source, optim_entries, progress), optim_out)
            return model_out, optim_out
        limit = strategy.chunk_size_bytes if strategy.name == UnshardStrategyType.chunks else 0
        model_dir = target / "model"
        _write_files(source, model_keys, model_dir, limit or 0, use_safetensors, progress)
        optim_dir = None
        if optim:
            optim_dir = target / "optim"
            tensors = [(k, name) for k, name in optim_entries if k in source.index.tensors]
            others = [(path, k) for k, path in _optim_paths(source) if k not in source.index.tensors]
            _write_files(source, tensors, optim_dir, limit or 0, False, progress)
            _atomic_torch_save(_build(source, others), optim_dir / "objects.pt")
        return model_dir, optim_dir
    finally:
        progress.close()


def _split(source: _Source) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(flat key, output name)`` of the model's tensors and the optimizer's entries."""
    if source.paths is None:  # a Megatron-style checkpoint: every tensor, by its own key
        return [(k, k) for k in source.index.tensors], []
    model, optim = [], []
    for path in source.paths:
        key = ".".join(map(str, path))
        if path[0] == "model" and key in source.index.tensors:
            model.append((key, ".".join(map(str, path[1:]))))
        elif path[0] == "optim":
            optim.append((key, ".".join(map(str, path[1:]))))
    return model, optim


def _optim_paths(source: _Source) -> list[tuple[str, tuple]]:
    assert source.paths is not None
    return [(".".join(map(str, p)), p[1:]) for p in source.paths if p[0] == "optim"]


def _build_with_progress(source: _Source, entries: list[tuple[str, str]], progress: "_Progress") -> Any:
    built = _build(source, [(p, k) for k, p in _optim_paths(source)])
    progress.advance(sum(source.tensor_nbytes(k) for k, _ in entries if k in source.index.tensors))
    return built


def _save_pt(source: _Source, keys: list[tuple[str, str]], out: Path, progress: "_Progress") -> None:
    state: dict[str, torch.Tensor] = {}
    for key, name in keys:
        state[name] = source.read(key)
        progress.advance(source.tensor_nbytes(key))
    _atomic_torch_save(state, out)


def _stream_safetensors(source: _Source, keys: list[tuple[str, str]], out: Path, progress: "_Progress") -> None:
    """One safetensors file written tensor by tensor: memory for one tensor at a time."""
    entries = []
    for key, name in keys:
        shape, dtype = source.tensor_meta(key)
        entries.append(Entry(name, safetensors_code(dtype), shape, _nbytes(shape, dtype)))
    prefix, _ = build_header(entries, {"format": "pt"})
    partial = out.with_name(out.name + ".partial")
    with open(partial, "wb") as f:
        f.write(prefix)
        for key, _ in keys:
            data = source.read(key)
            f.write(tensor_bytes(data))
            progress.advance(data.numel() * data.element_size())
            del data
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, out)


def _write_files(
    source: _Source, keys: list[tuple[str, str]], directory: Path, limit: int,
    use_safetensors: bool, progress: "_Progress",
) -> None:
    """One file per tensor (``limit == 0``) or files of about ``limit`` bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    suffix = ".safetensors" if use_safetensors else ".pt"
    group: list[tuple[str, str]] = []
    size = 0
    number = 0

    def flush() -> None:
        nonlocal group, size, number
        if not group:
            return
        if limit:
            out = directory / f"chunk-{number:05d}{suffix}"
        else:
            out = directory / (_file_name(group[0][1]) + suffix)
        if use_safetensors:
            _stream_safetensors(source, group, out, progress)
        elif limit:
            _save_pt(source, group, out, progress)
        else:
            key = group[0][0]
            _atomic_torch_save(source.read(key), out)
            progress.advance(source.tensor_nbytes(key))
        number += 1
        group, size = [], 0

    for key, name in keys:
        nbytes = source.tensor_nbytes(key)
        if group and (not limit or size + nbytes > limit):
            flush()
        group.append((key, name))
        size += nbytes
    flush()


def _file_name(name: str) -> str:
    """A tensor name as a file name: characters other than letters, digits and ``._-`` are
    %-escaped, so distinct names give distinct files (``a/b`` -> ``a%2Fb``, ``a_b`` stays)."""
    return urllib.parse.quote(name, safe="._-") or "%"


def _atomic_torch_save(obj: Any, out: Path) -> None:
    partial = out.with_name(out.name + ".partial")
    torch.save(obj, partial)
    with open(partial, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(partial, out)


def _require_single_process(what: str) -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(f"{what} runs in a single process; call it outside the distributed job")


class _Progress:
    """A one-line progress bar on stderr (bytes of tensors written)."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.quiet = quiet
        self.live = sys.stderr.isatty()  # redraw in place on a terminal; one line otherwise
        self.started = time.monotonic()
        self.last = 0.0
        self.width = 30

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.live and not self.quiet and (now - self.last > 0.1 or self.done >= self.total):
            self.last = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        fraction = min(self.done / self.total, 1.0)
        filled = int(fraction * self.width)
        rate = self.done / max(now - self.started, 1e-9)
        sys.stderr.write(
            f"\runsharding [{'#' * filled}{'.' * (self.width - filled)}] {fraction:6.1%} "
            f"{_human(self.done)}/{_human(self.total)} {_human(rate)}/s"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if not self.quiet:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()
