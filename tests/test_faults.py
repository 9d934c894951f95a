"""Fault injection: processes killed mid-save, corruption, hostile input, concurrent writers and
readers, disk full, permission denied, a rank that never joins. Every guarantee of
docs/reliability.md names the test here that backs it."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import pytest
import torch
import torch.distributed as tdist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_format import _mutate

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt.cli import main as cli_main
from distckpt.errors import (
    CheckpointExistsError,
    CheckpointingException,
    CheckpointNotFoundError,
    ChecksumError,
    CollectiveError,
    ConcurrentModificationError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    StorageError,
    TruncatedFileError,
    UnsafeCheckpointError,
)
from distckpt.format.index import CheckpointIndex
from distckpt.format.metadata import CheckpointMetadata
from distckpt.storage import LocalStorage
from distckpt.strategies.async_utils import AsyncCallsQueue

from _dist import RankFailure

ROWS, COLS = 64, 48


def values(key: str, version: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (1 + len(key)) + 1000 * version


def state(rank: int, world: int, version: int) -> dict:
    return {
        "version": version,
        "a": ShardedTensor.from_rank_offsets("a", values("a", version).chunk(world)[rank].clone(), (0, rank, world)),
        "bb": ShardedTensor.from_rank_offsets("bb", values("bb", version).chunk(world)[rank].clone(), (0, rank, world)),
        "rng": ShardedObject("rng", {"rank": rank, "version": version}, (world,), (rank,)),
    }


def assert_version(path, version: int) -> None:
    plain = distckpt.load_plain_tensors(path)
    assert torch.equal(plain["a"], values("a", version)) and torch.equal(plain["bb"], values("bb", version))
    assert distckpt.load_common_state_dict(path)["version"] == version


def _save(path, version: int, mode: str = "sync", overwrite: bool = False, storage=None) -> None:
    target = storage(path) if storage is not None else path
    data = state(tdist.get_rank(), tdist.get_world_size(), version)
    if mode == "sync":
        distckpt.save(data, target, overwrite=overwrite)
        return
    queue = AsyncCallsQueue()
    queue.schedule_async_request(distckpt.save(data, target, async_sharded_save=True, overwrite=overwrite))
    queue.maybe_finalize_async_calls(blocking=True)


# ---------------------------------------------------------------------------------------------
# 1. kill -9 mid-save


def _arm(point: str) -> None:
    """Make this process die by SIGKILL at ``point`` of the next save."""
    from distckpt.engine import save_job
    from distckpt.format.metadata import METADATA_FILE
    from distckpt.storage import local

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "data":  # half of the first write of a data file reaches the disk
        original = local._LocalWriter.write

        def write(self, data):
            view = memoryview(data).cast("B")
            original(self, view[: max(1, len(view) // 2)])
            die()

        local._LocalWriter.write = write
    elif point == "after-data":  # every data file written, nothing of the index
        save_job.SaveJob.finalize = lambda self, outcome: (outcome(), die())
    elif point == "commit":  # index and common state written, not the commit marker
        for name in ("write_atomic", "create_atomic"):
            original_fn = getattr(local.LocalStorage, name)

            def patched(self, file, data, _original=original_fn):
                if file == METADATA_FILE:
                    die()
                return _original(self, file, data)

            setattr(local.LocalStorage, name, patched)


def _crash_save(path: str, point: str, victims: list[int], mode: str) -> None:
    if tdist.get_rank() in victims:
        _arm(point)
    _save(path, 2, mode)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", ["data", "after-data", "commit"])
@pytest.mark.parametrize("who", ["one", "all"])
def test_kill_during_save(dist, tmp_path, point, who, mode):
    previous, path = str(tmp_path / "step1"), str(tmp_path / "step2")
    dist.run(2, _save, previous, 1)
    # the commit is the coordinator's (rank 0); otherwise kill a non-coordinator alone
    victims = [0, 1] if who == "all" else ([0] if point == "commit" else [1])
    with pytest.raises(RankFailure):
        dist.run(2, _crash_save, path, point, victims, mode, timeout=60)
    # the new checkpoint is refused, naming the missing commit marker
    with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError), match=path):
        distckpt.load_plain_tensors(path)
    if os.path.isdir(path) and os.listdir(path):
        with pytest.raises(IncompleteCheckpointError, match="metadata.json"):
            distckpt.load_plain_tensors(path)
    assert cli_main(["verify", path]) == 1
    # the previous checkpoint in the sibling directory loads bit-exactly
    assert_version(previous, 1)
    # a save retried into the same directory succeeds (the leftovers are ignored)
    dist.run(2, _save, path, 3, mode)
    assert_version(path, 3)
    assert cli_main(["verify", path]) == 0


# ---------------------------------------------------------------------------------------------
# 2. corruption: a specific error naming the file (and tensor), and `distckpt verify` fails


def _corrupt(path, kind: str) -> str:
    """Damage the checkpoint at ``path``; returns the name of the damaged file."""
    meta = CheckpointMetadata.from_json((path / "metadata.json").read_bytes(), "m")
    index = CheckpointIndex.from_json((path / meta.index.file).read_bytes(), "i")
    chunk = index.tensors["bb"].chunks[0]
    data = path / chunk.file
    if kind == "truncated data":
        data.write_bytes(data.read_bytes()[: chunk.data_offset + 10])
        return chunk.file
    if kind == "flipped data byte":
        raw = bytearray(data.read_bytes())
        raw[chunk.data_offset + 5] ^= 0x10
        data.write_bytes(bytes(raw))
        return chunk.file
    if kind == "missing data file":
        data.unlink()
        return chunk.file
    target = {"flipped index byte": meta.index.file, "flipped metadata byte": "metadata.json",
              "flipped common byte": meta.common.file}[kind]
    raw = bytearray((path / target).read_bytes())
    raw[len(raw) // 2] ^= 0x01
    (path / target).write_bytes(bytes(raw))
    return target


CORRUPTIONS = {
    "truncated data": TruncatedFileError,
    "flipped data byte": ChecksumError,
    "missing data file": StorageError,
    "flipped index byte": CorruptCheckpointError,
    "flipped metadata byte": CorruptCheckpointError,
    "flipped common byte": CorruptCheckpointError,
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corruption_is_detected(tmp_path, kind, capsys):
    distckpt.save(state(0, 1, 1), tmp_path)
    damaged = _corrupt(tmp_path, kind)
    with pytest.raises(CORRUPTIONS[kind]) as caught:
        distckpt.load(state(0, 1, 0), tmp_path)
    message = str(caught.value)
    assert damaged in message, message
    if kind in ("truncated data", "flipped data byte"):
        assert "'bb'" in message, message  # the tensor key
    if kind == "missing data file":
        assert "'a'" in message or "'bb'" in message, message  # a tensor the file holds
    assert cli_main(["verify", str(tmp_path)]) == 1
    assert damaged in capsys.readouterr().out


def test_index_pointing_outside_the_checkpoint_is_refused(tmp_path):
    distckpt.save(state(0, 1, 1), tmp_path)
    meta = CheckpointMetadata.from_json((tmp_path / "metadata.json").read_bytes(), "m")
    doc = json.loads((tmp_path / meta.index.file).read_text())
    doc["files"][0] = "../../outside.safetensors"
    raw = json.dumps(doc).encode()
    (tmp_path / meta.index.file).write_bytes(raw)
    from distckpt import checksum
    from distckpt.format.metadata import FileRef

    meta.index = FileRef(meta.index.file, len(raw), checksum.crc32c(raw))
    (tmp_path / "metadata.json").write_bytes(meta.to_json())  # a consistent forgery
    with pytest.raises(CorruptCheckpointError, match=meta.index.file):
        distckpt.load(state(0, 1, 0), tmp_path)
    assert cli_main(["verify", str(tmp_path)]) == 1


# ---------------------------------------------------------------------------------------------
# 3. hostile input


class Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/distckpt-exploited",))


def test_pickle_that_runs_code_is_refused_everywhere(tmp_path):
    if os.path.exists("/tmp/distckpt-exploited"):
        os.unlink("/tmp/distckpt-exploited")
    distckpt.save({"evil": Exploit(), "obj": ShardedObject("o", Exploit(), (1,), (0,))}, tmp_path)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        distckpt.load_common_state_dict(tmp_path)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        distckpt.load({"obj": ShardedObject("o", None, (1,), (0,))}, tmp_path)
    assert not os.path.exists("/tmp/distckpt-exploited")


_ODD = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=10), st.lists(st.integers(-5, 2**62), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz")
    distckpt.save(state(0, 1, 1), path)
    meta = json.loads((path / "metadata.json").read_text())
    index = json.loads((path / meta["index"]["file"]).read_text())
    return meta, index


def _mutated(doc, mutations) -> bytes:
    return json.dumps(_mutate(doc, mutations), allow_nan=True).encode()


def _only_library_errors(parse) -> None:
    try:
        parse()
    except CheckpointingException:
        pass


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=2000,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@fuzz(4000)
@given(mutations=st.lists(st.tuples(st.integers(0, 10_000), _ODD), min_size=1, max_size=4))
def test_fuzz_index_reader(documents, mutations):
    raw = _mutated(documents[1], mutations)
    _only_library_errors(lambda: CheckpointIndex.from_json(raw, "index.json"))


@fuzz(3000)
@given(mutations=st.lists(st.tuples(st.integers(0, 10_000), _ODD), min_size=1, max_size=4))
def test_fuzz_metadata_reader(documents, mutations):
    raw = _mutated(documents[0], mutations)
    _only_library_errors(lambda: CheckpointMetadata.from_json(raw, "metadata.json"))


@fuzz(3000)
@given(raw=st.binary(max_size=300), forged=st.integers(0, 2**64 - 1))
def test_fuzz_raw_bytes_and_forged_sizes(raw, forged):
    from distckpt.format.safetensors import parse_header

    _only_library_errors(lambda: CheckpointIndex.from_json(raw, "i"))
    _only_library_errors(lambda: CheckpointMetadata.from_json(raw, "m"))
    # a forged header length must be refused before anything of that size is allocated
    _only_library_errors(lambda: parse_header(forged.to_bytes(8, "little") + raw, "d"))


# ---------------------------------------------------------------------------------------------
# 4. concurrency


def test_two_jobs_saving_into_one_directory(tmp_path, monkeypatch):
    from distckpt.engine import save_job

    both_ready = threading.Barrier(2, timeout=30)
    real_commit = save_job.commit

    def racing_commit(*args, **kwargs):
        both_ready.wait()  # both saves wrote their data; now both try to commit
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(save_job, "commit", racing_commit)
    outcomes: dict[int, object] = {}

    def job(version: int) -> None:
        try:
            distckpt.save(state(0, 1, version), tmp_path)
            outcomes[version] = "ok"
        except CheckpointingException as exc:
            outcomes[version] = exc

    threads = [threading.Thread(target=job, args=(v,)) for v in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    winners = [v for v, o in outcomes.items() if o == "ok"]
    losers = [o for o in outcomes.values() if o != "ok"]
    assert len(winners) == 1 and len(losers) == 1, outcomes
    assert isinstance(losers[0], CheckpointExistsError) and "another save" in str(losers[0])
    assert_version(tmp_path, winners[0])  # consistent: all of the winner, nothing of the loser
    assert cli_main(["verify", str(tmp_path)]) == 0


def test_reader_never_sees_a_mix_during_overwrites(tmp_path):
    distckpt.save(state(0, 1, 0), tmp_path)
    stop = threading.Event()

    def writer() -> None:
        version = 0
        while not stop.is_set():
            version += 1
            distckpt.save(state(0, 1, version), tmp_path, overwrite=True)

    thread = threading.Thread(target=writer)
    thread.start()
    seen, refused = set(), 0
    try:
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline and len(seen) < 15:
            request = state(0, 1, -1)
            try:
                loaded = distckpt.load(request, tmp_path)
            except (ConcurrentModificationError, IncompleteCheckpointError, CheckpointNotFoundError):
                refused += 1
                continue
            version = loaded["version"]
            assert torch.equal(loaded["a"], values("a", version)), "tensor 'a' from another version"
            assert torch.equal(loaded["bb"], values("bb", version)), "tensor 'bb' from another version"
            assert loaded["rng"]["version"] == version
            seen.add(version)
    finally:
        stop.set()
        thread.join()
    assert len(seen) >= 3, (seen, refused)  # loads did succeed during the overwrites


# ---------------------------------------------------------------------------------------------
# 5. resource faults


class FailingStorage(LocalStorage):
    """A local directory whose writers fail like a full disk (after ``budget`` bytes) or
    like a permission problem."""

    def __init__(self, root, failure: str, budget: int = 4096) -> None:
        super().__init__(root)
        self.failure, self.budget = failure, budget

    def open_writer(self, name):
        if self.failure == "permission":
            raise PermissionError(errno.EACCES, "Permission denied", self._path(name))
        writer = super().open_writer(name)
        storage = self
        original = writer.write

        def write(data):
            storage.budget -= len(memoryview(data).cast("B"))
            if storage.budget < 0:
                raise OSError(errno.ENOSPC, "No space left on device", writer.path)
            original(data)

        writer.write = write  # type: ignore[method-assign]
        return writer


def _save_with_failing_rank(path: str, failure: str, mode: str) -> str:
    failing = tdist.get_rank() == 1
    try:
        _save(path, 1, mode, storage=(lambda p: FailingStorage(p, failure)) if failing else None)
    except CheckpointingException as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("failure", ["disk full", "permission"])
def test_write_failure_on_one_rank_fails_every_rank(dist, tmp_path, failure, mode):
    path = str(tmp_path / "ckpt")
    outcomes = dist.run(2, _save_with_failing_rank, path, failure, mode)
    expected = "No space left" if failure == "disk full" else "Permission denied"
    for outcome in outcomes:
        assert outcome.startswith("StorageError") and expected in outcome and "rank 1" in outcome, outcome
    assert not os.path.exists(os.path.join(path, "metadata.json"))
    assert [f for f in os.listdir(path) if not f.startswith(".")] == []  # the failed save's files removed


def _mount_tmpfs(path: str, size: str) -> bool:
    os.makedirs(path, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], capture_output=True)
    return done.returncode == 0


def _save_big(path: str) -> str:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    big = torch.ones(1024, 512)  # 2 MiB per rank into a 1 MiB filesystem
    try:
        distckpt.save({"big": ShardedTensor.from_rank_offsets("big", big, (0, rank, world))}, path)
    except CheckpointingException as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_real_full_filesystem(dist, tmp_path):
    mount = str(tmp_path / "small")
    if not _mount_tmpfs(mount, "1m"):
        pytest.skip("mounting a tmpfs is not permitted here (FailingStorage covers disk full)")
    try:
        outcomes = dist.run(2, _save_big, os.path.join(mount, "ckpt"))
        for outcome in outcomes:
            assert outcome.startswith("StorageError") and "No space left" in outcome, outcome
        assert not os.path.exists(os.path.join(mount, "ckpt", "metadata.json"))
        assert [f for f in os.listdir(os.path.join(mount, "ckpt")) if not f.startswith(".")] == []
    finally:
        subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(mount, ignore_errors=True)


def _one_rank_never_joins(path: str) -> str:
    from datetime import timedelta

    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    if tdist.get_rank() == 1:
        return "absent"  # this rank never calls save
    started = time.monotonic()
    try:
        distckpt.save(state(0, 1, 1) | {"a": ShardedTensor.from_rank_offsets("a", values("a", 1))}, path,
                      process_group=group)
    except CollectiveError as exc:
        return f"CollectiveError after {time.monotonic() - started:.1f} s: {exc}"
    return "saved"


def test_a_rank_that_never_joins_times_out_with_a_clear_error(dist, tmp_path):
    path = str(tmp_path / "ckpt")
    outcome, absent = dist.run(2, _one_rank_never_joins, path, timeout=60)
    assert absent == "absent"
    assert outcome.startswith("CollectiveError") and "timeout" in outcome, outcome
    assert float(outcome.split(" after ")[1].split(" s")[0]) < 30
    assert not os.path.exists(os.path.join(path, "metadata.json"))
