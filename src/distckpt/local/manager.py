"""Node-local checkpoints with peer replication (Megatron-Core's local checkpoint manager,
made safer), for fast saves and fast recovery.

Layout under each rank's node-local ``root_dir`` (ranks of one node may share it)::

    iter_0000100/holder_00003/data-<save id>-r00003-0.safetensors   rank 3's own piece
    iter_0000100/holder_00003/piece-r00003.json                     ... and its record
    iter_0000100/holder_00003/data-<save id>-r00001-0.safetensors   a replica of rank 1's piece
    iter_0000100/holder_00003/piece-r00001.json

A *piece* is what one rank saved: a data file in distckpt's own format (safetensors chunks
with crc32c per block) and a record (``piece-r<owner>.json``) holding this rank's index
records, the hollow TensorAwareStateDict and the crc32c of the data file, itself checksummed.
Every file is written to a unique temporary name, fsync'd and renamed; the record comes last,
so a piece without a record is a leftover of a crash and is removed.

Replication: rank ``r``'s piece is also held by ``r + k * replication_stride`` (mod the world
size) for ``k = 1 .. replication_factor - 1``; with the stride set to the ranks per node the
copies live on other nodes. It runs in a background thread over a dedicated gloo group.

The records of all pieces together are a regular distckpt index, so beyond the model this
follows, :meth:`LocalCheckpointManager.load_resharded` loads an iteration into another world
size or layout (bytes a rank lacks are sent by a rank holding them).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from .. import checksum
from ..engine.checkpoint import CheckpointReader
from ..engine.collective import Coordinator
from ..engine.io import write_rank_files
from ..engine.load import load_objects, load_tensors
from ..engine.save import build_index, describe_local
from ..engine.staging import POOL, stage
from ..errors import CheckpointingException, CorruptCheckpointError
from ..format.index import DEFAULT_BLOCK_BYTES, CheckpointIndex
from ..format.metadata import METADATA_FILE, CheckpointMetadata, FileRef
from ..mapping import ShardedObject, ShardedTensor
from ..planning.save_plan import plan_save
from ..storage.base import Storage, Writer
from ..storage.local import LocalStorage
from ..strategies.async_utils import AsyncRequest
from ..strategies.torch_common import TorchLoadCommonStrategy, TorchSaveCommonStrategy
from ..tensor_aware import TensorAwareStateDict

logger = logging.getLogger(__name__)

_ITER = re.compile(r"^iter_(\d{7,})$")
_RECORD = re.compile(r"^piece-r(\d{5})\.json$")
RECORD_FORMAT = "distckpt-local-piece"


class NotRecoverableLocallyError(CheckpointingException):
    """No iteration has every rank's piece on some surviving holder: load the global
    checkpoint instead."""


@dataclass(frozen=True)
class Piece:
    """A committed piece as found in a holder directory."""

    iteration: int
    owner: int
    world_size: int
    save_id: str
    holder: int  # the rank that found it (and can send it)
    directory: str  # where, on that rank's node
    record: dict


class LocalCheckpointManager:
    """Saves and loads TensorAwareStateDicts in node-local storage (collective calls).

    Args:
        root_dir: this rank's node-local directory (e.g. a local NVMe or ``/dev/shm``).
        replication_factor: copies of each rank's piece, the own one included (1: none).
        replication_stride: distance in ranks between the holders of a piece; the ranks per
            node puts the copies on other nodes.
        keep_last: iterations kept (older ones are removed after each successful save).
        process_group: the ranks taking part (default: all).
        timeout: seconds a transfer between ranks may wait for its peer (replication and
            fetches) before failing instead of hanging.
    """

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        *,
        replication_factor: int = 1,
        replication_stride: int = 1,
        keep_last: int = 2,
        process_group: Any | None = None,
        block_bytes: int = DEFAULT_BLOCK_BYTES,
        timeout: float = 600.0,
    ) -> None:
        self.root = os.path.abspath(os.fspath(root_dir))
        self.coordinator = Coordinator(process_group)
        self.rank, self.world_size = self.coordinator.rank, self.coordinator.world_size
        if replication_factor < 1 or keep_last < 1:
            raise ValueError("replication_factor and keep_last must be at least 1")
        holders = {(self.rank + k * replication_stride) % self.world_size for k in range(replication_factor)}
        if len(holders) != replication_factor:
            raise ValueError(
                f"replication_factor={replication_factor} with replication_stride={replication_stride} "
                f"does not give distinct holders among {self.world_size} ranks"
            )
        self.replication_factor = replication_factor
        self.replication_stride = replication_stride
        self.keep_last = keep_last
        self.block_bytes = block_bytes
        self._group = None
        if self.coordinator.distributed and self.world_size > 1:
            ranks = dist.get_process_group_ranks(self.coordinator.group)
            self._group = dist.new_group(ranks=ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        self._background: threading.Thread | None = None
        self._background_error: BaseException | None = None
        self._found: dict[int, dict[int, list[Piece]]] | None = None

    # -- paths -------------------------------------------------------------------------------

    def _holder_dir(self, iteration: int, holder: int | None = None) -> str:
        holder = self.rank if holder is None else holder
        return os.path.join(self.root, f"iter_{iteration:07d}", f"holder_{holder:05d}")

    def holders_of(self, owner: int) -> list[int]:
        return [(owner + k * self.replication_stride) % self.world_size for k in range(self.replication_factor)]

    # -- save --------------------------------------------------------------------------------

    def save(self, state: TensorAwareStateDict, iteration: int, is_async: bool = False) -> AsyncRequest | None:
        """Save this rank's piece of ``iteration`` (collective) and replicate it to its peers.

        Synchronous: returns once the own piece is durable (replication goes on in the
        background and is awaited by the next call of this manager). Async: returns an
        :class:`AsyncRequest` to schedule on an ``AsyncCallsQueue``; the tensors are copied
        first, so they may change as soon as this returns.
        """
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        self.wait_for_replication()
        tensors = list(state.tensors)
        originals = state.pop_tensors()
        try:
            hollow = state.hollow_to_bytes()
        finally:
            state.insert_tensors(originals)
        sharded = [st for st in state._sharded_tensors]  # noqa: SLF001 - same package
        objects = [o for o in _objects(state.sharded_state_dict)]
        save_id = uuid.uuid4().hex[:16]
        local = describe_local(sharded, objects, TorchSaveCommonStrategy().serialize)
        local.tensor_data = tensors
        # Every shard a rank keeps is written by it (replicas were dropped by the TASD algorithm).
        local.tensors = [replace(s, main=True) for s in local.tensors]
        local.objects = [replace(o, main=True) for o in local.objects]
        plan = plan_save([local.tensors], [local.objects])[0]
        chunks, data, staged = plan.chunks, local.tensor_data, None
        if is_async or any(t.device.type != "cpu" for t in data):
            # A snapshot in reusable host buffers: training may change the tensors right away.
            staged = stage(plan.chunks, local.tensor_data)
            chunks, data = staged.chunks, staged.tensors

        def write() -> None:
            try:
                self._cleanup(iteration)
                directory = self._holder_dir(iteration)
                os.makedirs(directory, exist_ok=True)
                storage = _AtomicDir(directory)
                records = write_rank_files(
                    storage, f"data-{save_id}-r{self.rank:05d}", chunks, data,
                    [(local.objects[i], local.object_bytes[i]) for i in plan.objects], self.block_bytes,
                )
            finally:
                if staged is not None:
                    POOL.release(staged.buffer)
            index = build_index([local.tensors], [records], self.block_bytes)
            files = [{"name": name, "size": storage.written[name][0], "crc32c": storage.written[name][1]}
                     for name in index.files]
            record = {
                "format": RECORD_FORMAT, "version": 1, "iteration": iteration, "owner": self.rank,
                "world_size": self.world_size, "save_id": save_id, "files": files,
                "index": json.loads(index.to_json()), "hollow": json.loads(hollow),
            }
            storage.write_atomic(f"piece-r{self.rank:05d}.json", _sealed(record))

        if not is_async:
            self.coordinator.exchange("writing the local piece", write)
            self._start_background(lambda: self._replicate(iteration))
            self._retain()
            return None

        outcome: dict[str, BaseException] = {}

        def in_background() -> None:
            try:
                write()
                self._replicate(iteration)
            except BaseException as exc:  # noqa: BLE001 - reported at finalize on every rank
                outcome["error"] = exc

        def finalize_async() -> None:
            def check() -> None:
                if "error" in outcome:
                    raise outcome["error"]

            self.coordinator.exchange("async local save", check)
            self._retain()

        return AsyncRequest(in_background, (), [finalize_async])

    def _start_background(self, fn: Callable[[], None]) -> None:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - raised by wait_for_replication
                self._background_error = exc

        self._background = threading.Thread(target=run, name="distckpt-replication", daemon=True)
        self._background.start()

    def wait_for_replication(self) -> None:
        """Wait for the background replication of the last save (collective); if it failed on
        any rank, raise on every rank."""

        def join() -> None:
            thread, self._background = self._background, None
            if thread is not None:
                thread.join()
            error, self._background_error = self._background_error, None
            if error is not None:
                raise CheckpointingException(f"replication of the previous local save failed: {error}") from error

        self.coordinator.exchange("waiting for replication", join)

    def _replicate(self, iteration: int) -> None:
        """Send this rank's piece to its peers and store the pieces of the ranks it holds."""
        if self.replication_factor == 1 or self._group is None:
            return
        sends = self.holders_of(self.rank)[1:]
        receives = [o for o in range(self.world_size) if self.rank in self.holders_of(o)[1:]]
        payload = _pack_piece(self._holder_dir(iteration), self.rank)
        received = _exchange_bytes(self._group, {peer: payload for peer in sends}, receives)
        for owner, raw in received.items():
            _unpack_piece(raw, self._holder_dir(iteration), owner)

    # -- finding and loading -----------------------------------------------------------------

    def _local_pieces(self) -> list[Piece]:
        found: list[Piece] = []
        if not os.path.isdir(self.root):
            return found
        for name in os.listdir(self.root):
            m = _ITER.match(name)
            if not m:
                continue
            # Every holder directory of this node: after a restart with another world size,
            # the pieces of ranks that no longer exist are still here.
            iteration_dir = os.path.join(self.root, name)
            for holder in sorted(os.listdir(iteration_dir)):
                directory = os.path.join(iteration_dir, holder)
                if not holder.startswith("holder_") or not os.path.isdir(directory):
                    continue
                for file in sorted(os.listdir(directory)):
                    if not _RECORD.match(file):
                        continue
                    try:
                        record = _open_record(os.path.join(directory, file))
                    except CorruptCheckpointError as exc:
                        logger.warning("ignoring %s", exc)
                        continue
                    found.append(Piece(record["iteration"], record["owner"], record["world_size"],
                                       record["save_id"], self.rank, directory, record))
        return found

    def _gather_pieces(self) -> dict[int, dict[int, list[Piece]]]:
        """iteration -> owner -> pieces held (any holder), from every rank (collective)."""
        self.wait_for_replication()
        mine = self.coordinator.exchange("listing local pieces", self._local_pieces)
        found: dict[int, dict[int, list[Piece]]] = {}
        for pieces in mine:
            for p in pieces:
                found.setdefault(p.iteration, {}).setdefault(p.owner, []).append(p)
        self._found = found
        return found

    def find_latest(self) -> int:
        """The newest iteration whose every piece is held by some rank (collective); -1 if none
        (then the job must fall back to its global checkpoint)."""
        found = self._gather_pieces()
        for iteration in sorted(found, reverse=True):
            if _complete(found[iteration]) is not None:
                return iteration
        return -1

    def _complete_iteration(self, iteration: int | None) -> tuple[int, dict[int, list[Piece]]]:
        found = self._gather_pieces()
        if iteration is None:
            complete = [i for i in sorted(found, reverse=True) if _complete(found[i]) is not None]
            if not complete:
                raise NotRecoverableLocallyError(
                    f"no iteration is recoverable from the node-local checkpoints under {self.root} and "
                    "its peers (some rank's piece has no surviving holder); load the global checkpoint"
                )
            iteration = complete[0]
        owners = _complete(found.get(iteration, {}))
        if owners is None:
            have = sorted(found.get(iteration, {}))
            raise NotRecoverableLocallyError(
                f"iteration {iteration} is not recoverable locally: pieces of ranks "
                f"{sorted(set(range(_world_of(found.get(iteration, {})))) - set(have))} have no surviving "
                "holder; load the global checkpoint"
            )
        return iteration, owners

    def load(self, iteration: int | None = None) -> TensorAwareStateDict:
        """This rank's TensorAwareStateDict of ``iteration`` (default: the latest recoverable),
        fetched from a peer if the own copy is lost or fails its checksum (collective). The
        world size must be the one that saved; see :meth:`load_resharded` otherwise."""
        iteration, owners = self._complete_iteration(iteration)
        world = owners[0][0].world_size
        if world != self.world_size:
            raise CheckpointingException(
                f"iteration {iteration} was saved by {world} ranks, this job has {self.world_size}: "
                "use load_resharded() with a sharded state dict of the new layout"
            )
        directory = self._fetch(iteration, owners, {self.rank})
        out: dict[str, TensorAwareStateDict] = {}

        def read_piece() -> None:
            record = _open_record(os.path.join(directory[self.rank], f"piece-r{self.rank:05d}.json"))
            state = TensorAwareStateDict.from_hollow_bytes(json.dumps(record["hollow"]).encode())
            reader = CheckpointReader(_union_storage(iteration, {self.rank: (directory[self.rank], record)}, None))
            shards = [replace(st, data=None) for st in state._sharded_tensors]  # noqa: SLF001
            load_tensors(reader, shards)
            state.insert_tensors([st.data for st in shards])  # type: ignore[misc]
            objects = _objects(state.sharded_state_dict)
            for obj, value in zip(objects, load_objects(reader, objects, TorchLoadCommonStrategy().deserialize)):
                obj.data = value
            out["state"] = state

        self.coordinator.exchange("reading the local piece", read_piece)  # errors reach every rank
        return out["state"]

    def load_resharded(self, sharded_state_dict: dict, iteration: int | None = None, **load_kwargs: Any) -> dict:
        """Load ``iteration`` into ``sharded_state_dict`` of any layout and world size, as
        ``distckpt.load`` does from a global checkpoint: the pieces' records form its index,
        and the data files a rank needs come from local copies or are sent by their holders."""
        from .. import serialization

        iteration, owners = self._complete_iteration(iteration)
        chosen = {owner: pieces[0] for owner, pieces in owners.items()}
        records = {owner: piece.record for owner, piece in chosen.items()}
        # Every rank learns every record (small): the holder listed first sends it.
        shared = self.coordinator.all_gather(
            {o: r for o, r in records.items() if chosen[o].holder == self.rank}
        )
        for part in shared:
            records.update(part)
        union = _union_storage(iteration, {o: (None, r) for o, r in records.items()}, None)
        reader = CheckpointReader(union)
        requested = [x for x in _leaves(sharded_state_dict) if isinstance(x, (ShardedTensor, ShardedObject))]
        files = _files_for(reader, requested)
        needed_owners = {owner for owner, r in records.items() if any(f["name"] in files for f in r["files"])}
        directories = self._fetch(iteration, owners, needed_owners)
        union.attach({o: directories[o] for o in needed_owners})
        return serialization.load(sharded_state_dict, union, **load_kwargs)  # type: ignore[return-value]

    def _fetch(self, iteration: int, owners: dict[int, list[Piece]], wanted: set[int]) -> dict[int, str]:
        """Directories holding verified copies of the pieces of ``wanted`` owners, fetching from
        holders what this rank lacks or what fails its checksum (collective)."""
        directories: dict[int, str] = {}
        failed: dict[int, set[int]] = {o: set() for o in wanted}
        mine = self._holder_dir(iteration)
        here = {(p.owner): p.directory for ps in owners.values() for p in ps if p.holder == self.rank}
        for owner in wanted:
            for p in owners[owner]:
                if p.holder == self.rank and owner not in directories and _verify_piece(p.directory, owner):
                    directories[owner] = p.directory
            if owner not in directories and any(p.holder == self.rank for p in owners[owner]):
                failed[owner].add(self.rank)
        for _ in range(self.replication_factor + 1):
            requests = {}
            for owner in wanted - set(directories):
                candidates = [p.holder for p in owners[owner] if p.holder not in failed[owner] and p.holder != self.rank]
                if candidates:
                    requests[owner] = candidates[0]
            everyone = self.coordinator.all_gather(requests)
            if not any(everyone):
                break
            outgoing: dict[int, dict[int, bytearray]] = {}
            for requester, asked in enumerate(everyone):
                for owner, holder in asked.items():
                    if holder == self.rank:
                        outgoing.setdefault(requester, {})[owner] = _pack_piece(here.get(owner, mine), owner)
            sends = {peer: _join(parts) for peer, parts in outgoing.items()}
            incoming = sorted({holder for holder in requests.values()})
            if self._group is None:
                break
            received = _exchange_bytes(self._group, sends, incoming)
            for owner, holder in requests.items():
                parts = _split(received.get(holder, memoryview(b"")))
                raw = parts.get(owner)
                if raw is None:
                    failed[owner].add(holder)
                    continue
                try:
                    _unpack_piece(raw, mine, owner)
                    intact = _verify_piece(mine, owner)
                except (OSError, CheckpointingException) as exc:  # keep the rounds in step
                    logger.warning("rank %d: storing the piece of rank %d failed: %s", self.rank, owner, exc)
                    intact = False
                if intact:
                    directories[owner] = mine
                else:
                    failed[owner].add(holder)
        missing = sorted(wanted - set(directories))

        def report() -> None:
            if missing:
                raise NotRecoverableLocallyError(
                    f"rank {self.rank}: no intact copy of the pieces of ranks {missing} for iteration "
                    f"{iteration} (checksums failed or holders lost); load the global checkpoint"
                )

        self.coordinator.exchange("fetching local pieces", report)
        return directories

    # -- housekeeping -------------------------------------------------------------------------

    def _cleanup(self, iteration: int) -> None:
        """Remove what a crashed save left in this rank's holder directories: temporary files
        everywhere, and in ``iteration`` (about to be written) data files no record references
        and this rank's own record (the record is written last). Older iterations' orphans go
        with retention."""
        if not os.path.isdir(self.root):
            return
        for name in os.listdir(self.root):
            m = _ITER.match(name)
            if m is None:
                continue
            directory = self._holder_dir(int(m.group(1)))
            if not os.path.isdir(directory):
                continue
            files = os.listdir(directory)
            stale = {f for f in files if f.endswith(".partial")}
            if int(m.group(1)) == iteration:
                stale.add(f"piece-r{self.rank:05d}.json")  # this rank saves the iteration again
                referenced: set[str] = set()
                for file in files:
                    if _RECORD.match(file) and file not in stale:
                        try:
                            record = _open_record(os.path.join(directory, file))
                            referenced.update(f["name"] for f in record["files"])
                        except CorruptCheckpointError:
                            stale.add(file)
                stale.update(f for f in files if f.startswith("data-") and f not in referenced)
            for file in stale & set(files):
                try:
                    os.unlink(os.path.join(directory, file))
                except FileNotFoundError:
                    pass

    def _retain(self) -> None:
        """Keep the newest ``keep_last`` iterations of this rank's holder directories."""
        if not os.path.isdir(self.root):
            return
        iterations = sorted(int(m.group(1)) for m in map(_ITER.match, os.listdir(self.root)) if m)
        for iteration in iterations[: -self.keep_last]:
            directory = self._holder_dir(iteration)
            shutil.rmtree(directory, ignore_errors=True)
            parent = os.path.dirname(directory)
            try:
                os.rmdir(parent)  # only when the other holders of this node removed theirs too
            except OSError:
                pass


# ---------------------------------------------------------------------------------------------
# records, files and transfers


def _sealed(record: dict) -> bytes:
    body = json.dumps(record, sort_keys=True, separators=(",", ":"))
    return json.dumps({"record": record, "crc32c": checksum.crc32c(body.encode())},
                      separators=(",", ":")).encode()


def _open_record(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
        record = doc["record"]
        body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
        if checksum.crc32c(body) != doc["crc32c"] or record.get("format") != RECORD_FORMAT:
            raise ValueError("checksum mismatch")
        return record
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{path}: unreadable local piece record ({exc})") from exc


def _file_crc(path: str) -> int:
    value = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(8 << 20)
            if not block:
                return value
            value = checksum.crc32c(block, value)


def _verify_piece(directory: str, owner: int) -> bool:
    path = os.path.join(directory, f"piece-r{owner:05d}.json")
    try:
        record = _open_record(path)
        for f in record["files"]:
            file = os.path.join(directory, f["name"])
            if os.path.getsize(file) != f["size"] or _file_crc(file) != f["crc32c"]:
                logger.warning("%s: checksum mismatch in the local piece of rank %d", file, owner)
                return False
    except (CorruptCheckpointError, OSError):
        return False
    return True


def _pack_piece(directory: str, owner: int) -> bytearray:
    """A piece's files as one payload: ``{name: bytes}`` joined (record last)."""
    record_name = f"piece-r{owner:05d}.json"
    try:
        record = _open_record(os.path.join(directory, record_name))
        parts = {}
        for f in record["files"]:
            with open(os.path.join(directory, f["name"]), "rb") as file:
                parts[f["name"]] = file.read()
        with open(os.path.join(directory, record_name), "rb") as file:
            parts[record_name] = file.read()
    except (CorruptCheckpointError, OSError):
        return bytearray()
    return _join(parts)


def _unpack_piece(raw: bytes | bytearray | memoryview, directory: str, owner: int) -> None:
    parts = _split(raw)
    record_name = f"piece-r{owner:05d}.json"
    if record_name not in parts:
        return
    os.makedirs(directory, exist_ok=True)
    storage = _AtomicDir(directory)
    for name, data in parts.items():
        if name != record_name:
            storage.write_atomic(name, data)  # type: ignore[arg-type]  # (any bytes-like object)
    storage.write_atomic(record_name, parts[record_name])  # type: ignore[arg-type]  # the record last


def _join(parts: "dict[Any, bytes] | dict[Any, bytearray] | dict[str, bytes]") -> bytearray:
    header = json.dumps([[str(k), len(v)] for k, v in parts.items()]).encode()
    out = bytearray(len(header).to_bytes(8, "little"))
    out += header
    for part in parts.values():
        out += part
    return out


def _split(raw: bytes | bytearray | memoryview) -> dict[Any, memoryview]:
    """Views into ``raw`` (no copies) keyed by name."""
    raw = memoryview(raw)
    if not len(raw):
        return {}
    size = int.from_bytes(raw[:8], "little")
    entries = json.loads(bytes(raw[8 : 8 + size]))
    out, position = {}, 8 + size
    for name, length in entries:
        key: Any = int(name) if name.isdigit() else name
        out[key] = raw[position : position + length]
        position += length
    return out


def _exchange_bytes(group: Any, sends: dict[int, bytearray], receives: list[int]) -> dict[int, memoryview]:
    """Point-to-point: send ``sends[peer]`` to each peer, receive one payload from each rank of
    ``receives`` (group ranks). Sizes first, then payloads; all transfers posted at once."""
    global_rank = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    size_in = {src: torch.zeros(1, dtype=torch.int64) for src in receives}
    work = [dist.irecv(t, src=global_rank(src), group=group) for src, t in size_in.items()]
    work += [dist.isend(torch.tensor([len(data)], dtype=torch.int64), dst=global_rank(dst), group=group)
             for dst, data in sends.items()]
    for w in work:
        if w is not None:
            w.wait()
    data_in = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in size_in.items()}
    work = [dist.irecv(t, src=global_rank(src), group=group) for src, t in data_in.items() if t.numel()]
    work += [dist.isend(torch.frombuffer(data, dtype=torch.uint8), dst=global_rank(dst), group=group)
             for dst, data in sends.items() if data]
    for w in work:
        if w is not None:
            w.wait()
    return {src: memoryview(t.numpy()) for src, t in data_in.items()}  # type: ignore[arg-type]


def _complete(owners: dict[int, list[Piece]]) -> dict[int, list[Piece]] | None:
    """``owners`` if it has every rank of one save (the same world size), else None."""
    if not owners:
        return None
    world = _world_of(owners)
    if set(owners) >= set(range(world)) and all(p.world_size == world for ps in owners.values() for p in ps):
        return {o: ps for o, ps in owners.items() if o < world}
    return None


def _world_of(owners: dict[int, list[Piece]]) -> int:
    return max((p.world_size for ps in owners.values() for p in ps), default=0)


def _objects(tree: Any) -> list[ShardedObject]:
    return [x for x in _leaves(tree) if isinstance(x, ShardedObject)]


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [x for v in tree.values() for x in _leaves(v)]
    if isinstance(tree, list):
        return [x for v in tree for x in _leaves(v)]
    return [tree]


def _files_for(reader: CheckpointReader, requested: list[Any]) -> set[str]:
    """The data files holding any byte of the requested tensors and objects."""
    from ..planning.boxes import Box, intersect

    index = reader.index
    files: set[str] = set()
    for item in requested:
        if isinstance(item, ShardedObject):
            entry = index.objects.get(item.unique_key)
            if entry is not None:
                files.add(entry.file)
            continue
        tensor = index.tensors.get(item.key)
        if tensor is None:
            continue
        box = Box(item.global_offset, item.box_shape)
        for chunk in tensor.chunks:
            if intersect(box, Box(chunk.offset, chunk.shape)) is not None:
                files.add(chunk.file)
    return files


class _AtomicDir(LocalStorage):
    """A directory whose every file appears complete or not at all (temp name, fsync, rename);
    ``written`` has the size and crc32c of each file written through ``open_writer``."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.written: dict[str, tuple[int, int]] = {}

    def open_writer(self, name: str) -> Writer:
        return _RenamingWriter(self, name)


class _RenamingWriter(Writer):
    def __init__(self, storage: _AtomicDir, name: str) -> None:
        self.storage, self.name = storage, name
        self.final = os.path.join(storage.root, name)
        self.temp = f"{self.final}.{uuid.uuid4().hex[:8]}.partial"
        self.inner = LocalStorage(storage.root).open_writer(os.path.basename(self.temp))
        self.size, self.crc = 0, 0

    def write(self, data: memoryview) -> None:
        self.inner.write(data)
        self.size += len(memoryview(data).cast("B"))
        self.crc = checksum.crc32c(data, self.crc)

    def close(self) -> None:
        self.inner.close()
        os.replace(self.temp, self.final)
        self.storage.written[self.name] = (self.size, self.crc)

    def abort(self) -> None:
        self.inner.abort()


class _UnionStorage(Storage):
    """A read-only checkpoint assembled from pieces: metadata, index and common state in
    memory, data files from the directories holding verified copies."""

    def __init__(self, root: str, blobs: dict[str, bytes], paths: dict[str, str]) -> None:
        self.root, self.blobs, self.paths = root, blobs, paths

    def attach(self, directories: dict[int, str]) -> None:
        for directory in directories.values():
            for name in os.listdir(directory):
                if name.startswith("data-"):
                    self.paths.setdefault(name, os.path.join(directory, name))

    def exists(self, name: str) -> bool:
        return name in self.blobs or name in self.paths

    def list(self) -> list[str]:
        return sorted(set(self.blobs) | set(self.paths))

    def size(self, name: str) -> int:
        return len(self.blobs[name]) if name in self.blobs else os.path.getsize(self._path(name))

    def _path(self, name: str) -> str:
        if name not in self.paths:
            raise FileNotFoundError(f"{self.root}/{name}: not fetched to this rank")
        return self.paths[name]

    def read(self, name: str) -> bytes:
        if name in self.blobs:
            return self.blobs[name]
        with open(self._path(name), "rb") as f:
            return f.read()

    def read_into(self, name: str, offset: int, buffer: memoryview) -> None:
        if name in self.blobs:
            view = memoryview(buffer).cast("B")
            view[:] = self.blobs[name][offset : offset + len(view)]
            return
        LocalStorage(os.path.dirname(self._path(name))).read_into(os.path.basename(self._path(name)), offset, buffer)

    def open_writer(self, name: str) -> Writer:
        raise CheckpointingException("a checkpoint assembled from local pieces is read-only")

    def write_atomic(self, name: str, data: bytes) -> None:
        raise CheckpointingException("a checkpoint assembled from local pieces is read-only")

    def delete(self, name: str) -> None:
        raise CheckpointingException("a checkpoint assembled from local pieces is read-only")

    def prepare_root(self) -> None:
        raise CheckpointingException("a checkpoint assembled from local pieces is read-only")


def _union_storage(iteration: int, pieces: dict[int, tuple[str | None, dict]], _: Any) -> _UnionStorage:
    """The regular checkpoint formed by ``pieces`` (owner -> (directory or None, record))."""
    index = CheckpointIndex()
    save_ids = []
    for owner in sorted(pieces):
        directory, record = pieces[owner]
        part = CheckpointIndex.from_json(json.dumps(record["index"]).encode(), f"piece of rank {owner}")
        index.block_bytes = part.block_bytes
        for key, entry in part.tensors.items():
            if key in index.tensors:
                index.tensors[key].chunks = index.tensors[key].chunks + entry.chunks
            else:
                index.tensors[key] = entry
        index.objects.update(part.objects)
        save_ids.append(record["save_id"])
    for entry in index.tensors.values():
        entry.chunks = sorted(entry.chunks, key=lambda c: c.offset)
    first = pieces[min(pieces)][1]
    common = TensorAwareStateDict.from_hollow_bytes(json.dumps(first["hollow"]).encode()).common_state_dict
    index_raw = index.to_json()
    common_raw = TorchSaveCommonStrategy().serialize(common)
    save_id = "local" + "".join(sorted(save_ids))[:11]
    metadata = CheckpointMetadata(
        save_id=save_id,
        index=FileRef("index-local.json", len(index_raw), checksum.crc32c(index_raw)),
        common=FileRef("common-local.pt", len(common_raw), checksum.crc32c(common_raw)),
        world_size=first["world_size"],
        writer="distckpt local checkpoint manager",
    )
    blobs = {METADATA_FILE: metadata.to_json(), "index-local.json": index_raw, "common-local.pt": common_raw}
    paths = {}
    for directory, record in pieces.values():
        if directory is not None:
            for f in record["files"]:
                paths[f["name"]] = os.path.join(directory, f["name"])
    root = f"local-pieces://iteration-{iteration}/{'-'.join(sorted(save_ids))[:64]}"
    return _UnionStorage(root, blobs, paths)
