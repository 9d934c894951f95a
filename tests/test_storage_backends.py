"""One conformance suite for every storage backend (a local directory and a real S3 server),
plus the object-store fault tests: wrong credentials, a server killed mid-save, bytes read per
rank on a resharded load."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import torch
import torch.distributed as tdist

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt import checkpoint as ckpt
from distckpt.cli import main as cli_main
from distckpt.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumError,
    IncompleteCheckpointError,
    StorageError,
)
from distckpt.storage import ObjectStoreOptions, open_storage
from distckpt.strategies.async_utils import AsyncCallsQueue

from _s3 import ACCESS_KEY, REGION, S3Server

ROWS, COLS = 24, 10


def full(key: str) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * (1 + len(key))


def rows_state(rank: int, world: int, empty: bool = False) -> dict:
    state: dict = {"iteration": 7}
    for key in ("a", "bb"):
        part = full(key).chunk(world)[rank]
        state[key] = ShardedTensor.from_rank_offsets(
            key, torch.zeros_like(part) if empty else part.clone(), (0, rank, world)
        )
    state["rng"] = ShardedObject("rng", {"rank": rank}, (world,), (rank,))
    return state


def cols_request(rank: int, world: int) -> dict:
    state: dict = {}
    for key in ("a", "bb"):
        parts = full(key).chunk(world, dim=1)
        start = sum(p.shape[1] for p in parts[:rank])
        state[key] = ShardedTensor.from_global_offset(key, torch.zeros_like(parts[rank]), (ROWS, COLS), (0, start))
    return state


@pytest.fixture(params=["local", "s3"])
def backend(request, tmp_path):
    """``(make_location, env)``: fresh checkpoint locations of one backend, and the environment
    worker processes need to reach it."""
    if request.param == "local":
        return (lambda name: str(tmp_path / name)), {}
    server: S3Server = request.getfixturevalue("s3_server")
    bucket = server.create_bucket()
    run = uuid.uuid4().hex[:8]
    return (lambda name: f"s3://{bucket}/{run}/{name}"), server.env()


@pytest.fixture
def in_env(backend, monkeypatch):
    for key, value in backend[1].items():
        monkeypatch.setenv(key, value)
    return backend[0]


def _with_env(env: dict, fn, *args):
    os.environ.update(env)
    return fn(*args)


def _save_rows(location: str, overwrite: bool = False) -> None:
    distckpt.save(rows_state(tdist.get_rank(), tdist.get_world_size()), location, overwrite=overwrite)


def _load_cols(location: str) -> bool:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    loaded = distckpt.load(cols_request(rank, world), location)
    for key in ("a", "bb"):
        assert torch.equal(loaded[key], full(key).chunk(world, dim=1)[rank]), key
    assert loaded["iteration"] == 7
    return True


# ---------------------------------------------------------------------------------------------
# Conformance: the same behaviour on every backend


def test_resharded_save_and_load(dist, backend):
    location, env = backend
    url = location("ckpt")
    dist.run(4, _with_env, env, _save_rows, url)
    assert dist.run(2, _with_env, env, _load_cols, url) == [True, True]
    os.environ.update(env)
    plain = distckpt.load_plain_tensors(url)
    assert torch.equal(plain["a"], full("a")) and torch.equal(plain["bb"], full("bb"))
    objects = distckpt.load_sharded_metadata(url)
    assert sorted(k for k in objects if k.startswith("rng")) == [f"rng/shard_{r}_4" for r in range(4)]


def test_overwrite_semantics(dist, backend, in_env):
    url = in_env("ckpt")
    distckpt.save(rows_state(0, 1), url)
    first_files = set(open_storage(url).list())
    with pytest.raises(CheckpointExistsError, match="overwrite=True"):
        distckpt.save(rows_state(0, 1), url)
    assert set(open_storage(url).list()) == first_files  # nothing clobbered
    dist.run(2, _with_env, backend[1], _save_rows, url, True)
    files = open_storage(url).list()
    save_id = distckpt.engine.checkpoint.CheckpointReader(url).metadata.save_id
    assert all(save_id in f for f in files if f != "metadata.json"), files  # old files removed
    assert dist.run(2, _with_env, backend[1], _load_cols, url) == [True, True]


def test_remove_sharded_tensors(in_env):
    url = in_env("ckpt")
    distckpt.save(rows_state(0, 1), url)
    distckpt.remove_sharded_tensors(url, "bb")
    assert set(distckpt.load_tensors_metadata(url)) == {"a"}
    assert torch.equal(distckpt.load_plain_tensors(url)["a"], full("a"))


def test_incomplete_checkpoint_is_refused(in_env):
    url = in_env("ckpt")
    distckpt.save(rows_state(0, 1), url)
    open_storage(url).delete("metadata.json")
    with pytest.raises(IncompleteCheckpointError, match="metadata.json"):
        distckpt.load(rows_state(0, 1, empty=True), url)
    with pytest.raises(CheckpointNotFoundError):
        distckpt.load(rows_state(0, 1, empty=True), in_env("never-saved"))


def test_corruption_is_detected_and_verify_reports_it(in_env, capsys):
    url = in_env("ckpt")
    distckpt.save(rows_state(0, 1), url)
    assert cli_main(["verify", url]) == 0
    storage = open_storage(url)
    (data,) = [f for f in storage.list() if f.startswith("data-")]
    chunk = distckpt.engine.checkpoint.CheckpointReader(url).index.tensors["bb"].chunks[0]
    raw = bytearray(storage.read(data))
    raw[chunk.data_offset + 3] ^= 0xFF  # a flipped byte in tensor "bb"
    storage.write_atomic(data, bytes(raw))
    with pytest.raises(ChecksumError, match=f"{data}.*'bb'|'bb'.*{data}"):
        distckpt.load_plain_tensors(url)
    assert cli_main(["verify", url]) == 1
    assert data in capsys.readouterr().out


def _async_save(location: str) -> bool:
    queue = AsyncCallsQueue()
    state = rows_state(tdist.get_rank(), tdist.get_world_size())
    request = distckpt.save(state, location, async_sharded_save=True)
    state["a"].data.fill_(-1)  # modified after save returned: must not reach the checkpoint
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    return True


def test_async_save(dist, backend):
    location, env = backend
    url = location("async")
    assert dist.run(2, _with_env, env, _async_save, url) == [True, True]
    assert dist.run(3, _with_env, env, _load_cols, url) == [True, True, True]


def _save_model(location: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model = torch.nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 6)).sum().backward()
    optim.step()
    ckpt.save_model_and_optim_state(location, model, optim, throttle_uploads=True)


def test_model_checkpoint_unshard_and_pre_download(dist, backend, in_env, tmp_path):
    url = in_env("model")
    dist.run(2, _with_env, backend[1], _save_model, url)
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference(torch.ones(2, 6)).sum().backward()
    ref_optim.step()

    model_out, _ = ckpt.unshard_checkpoint(url, tmp_path / "out", quiet=True)
    state = torch.load(model_out, weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in reference.state_dict().items())

    cache = tmp_path / "cache"
    stamps = []
    for _attempt in range(2):
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ckpt.load_model_and_optim_state(url, model, optim, pre_download=True, work_dir=cache)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
        momentum = optim.state_dict()["state"][0]["momentum_buffer"]
        assert torch.equal(momentum, ref_optim.state_dict()["state"][0]["momentum_buffer"])
        stamps.append({p.name: p.stat().st_mtime_ns for p in cache.rglob("*")})
    assert stamps[0] == stamps[1]  # the second load reused the cached files
    cached = list(cache.rglob("data-*"))
    assert bool(cached) == url.startswith("s3://")  # local directories are read in place
    if cached:
        # a corrupted cached copy (same size) is caught by the chunk checksums
        index = distckpt.engine.checkpoint.CheckpointReader(url).index
        for path in cached:
            raw = bytearray(path.read_bytes())
            for entry in index.tensors.values():
                for chunk in entry.chunks:
                    if chunk.file == path.name and chunk.nbytes:
                        raw[chunk.data_offset] ^= 0xFF
            path.write_bytes(bytes(raw))
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
        with pytest.raises(ChecksumError):
            ckpt.load_model_and_optim_state(url, model, pre_download=True, work_dir=cache)


# ---------------------------------------------------------------------------------------------
# Object-store faults


def _expect_failure(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("the call succeeded")


def test_wrong_credentials_fail_clearly_and_write_nothing(dist, s3_server):
    bucket = s3_server.create_bucket()
    env = dict(s3_server.env(), AWS_SECRET_ACCESS_KEY="not-the-secret")
    url = f"s3://{bucket}/run/ckpt"
    errors = dist.run(2, _with_env, env, _expect_failure, _save_rows, url)
    for message in errors:
        assert "StorageError" in message and "access denied" in message and bucket in message
        assert "AWS_SECRET_ACCESS_KEY" in message
    assert s3_server.client().list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0
    # an explicit options object works where the environment is wrong
    options = ObjectStoreOptions(endpoint=s3_server.endpoint, access_key_id=ACCESS_KEY,
                                 secret_access_key="also-wrong", region=REGION)
    with pytest.raises(StorageError, match="access denied"):
        distckpt.save(rows_state(0, 1), open_storage(url, options))


def _save_then_kill_server(location: str, server_pgid: int) -> str:
    options = ObjectStoreOptions(max_retries=2, retry_timeout=3.0, connect_timeout=2.0, timeout=10.0)
    rank, world = tdist.get_rank(), tdist.get_world_size()
    state = rows_state(rank, world)
    state["big"] = ShardedTensor.from_rank_offsets("big", torch.randn(2048, 1024), (0, rank, world))
    queue = AsyncCallsQueue()
    request = distckpt.save(state, open_storage(location, options), async_sharded_save=True)
    queue.schedule_async_request(request)
    if rank == 0:
        os.killpg(server_pgid, signal.SIGKILL)  # the server dies while the ranks upload
    return _expect_failure(queue.maybe_finalize_async_calls, True)


def test_server_killed_mid_save(dist, tmp_path):
    server = S3Server(str(tmp_path / "server")).start()
    try:
        bucket = server.create_bucket()
        env = server.env()
        previous, new = f"s3://{bucket}/run/step1", f"s3://{bucket}/run/step2"
        dist.run(2, _with_env, env, _save_rows, previous)
        assert server.process is not None
        errors = dist.run(2, _with_env, env, _save_then_kill_server, new, os.getpgid(server.process.pid))
        for message in errors:  # every rank raised, naming what failed
            assert "StorageError" in message and bucket in message, message
        server.kill()
        server.start()  # same ports and data: the previous checkpoint must still be there
        server.wait_readable(bucket, "run/step1/metadata.json")
        os.environ.update(env)
        assert "metadata.json" not in open_storage(new).list()  # nothing looks complete
        with pytest.raises((IncompleteCheckpointError, CheckpointNotFoundError)):
            distckpt.load_plain_tensors(new)
        assert dist.run(2, _with_env, env, _load_cols, previous) == [True, True]
    finally:
        server.close()


def _bytes_read_on_resharded_load(location: str) -> tuple[int, int]:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    rows = torch.zeros(8192, 512).chunk(world)[rank]
    offset = sum(c.shape[0] for c in torch.zeros(8192, 512).chunk(world)[:rank])
    storage = open_storage(location)
    request = {"big": ShardedTensor.from_global_offset("big", rows, (8192, 512), (offset, 0))}
    distckpt.load(request, storage)
    expected = torch.arange(8192 * 512, dtype=torch.float32).reshape(8192, 512)[offset:offset + rows.shape[0]]
    assert torch.equal(request["big"].data, expected)
    return storage.bytes_read, rows.numel() * 4


def _save_big(location: str) -> None:
    rank, world = tdist.get_rank(), tdist.get_world_size()
    full_big = torch.arange(8192 * 512, dtype=torch.float32).reshape(8192, 512)
    distckpt.save({"big": ShardedTensor.from_rank_offsets("big", full_big.chunk(world)[rank].clone(),
                                                          (0, rank, world))}, location)


def test_resharded_load_reads_little_more_than_it_needs(dist, s3_server):
    env = s3_server.env()
    url = f"s3://{s3_server.create_bucket()}/ckpt"
    dist.run(4, _with_env, env, _save_big, url)  # 16 MiB, rows split 4 ways
    for read, needed in dist.run(3, _with_env, env, _bytes_read_on_resharded_load, url):
        # index and metadata included; data reads are aligned to 256 KiB checksum blocks
        assert read <= 1.1 * needed, (read, needed)


def _throttled_save(location: str, log: str) -> None:
    import time

    from distckpt.storage.object_store import ObjectStoreStorage

    original = ObjectStoreStorage.upload_slot

    def recording_slot(self):
        slot = original(self)

        class Recorded:
            def __enter__(self_inner):
                slot.__enter__()
                start = time.monotonic()
                self_inner.start = start

            def __exit__(self_inner, *exc):
                end = time.monotonic()
                with open(log, "a") as f:
                    f.write(f"{tdist.get_rank()} {self_inner.start} {end}\n")
                return slot.__exit__(*exc)

        return Recorded()

    ObjectStoreStorage.upload_slot = recording_slot  # type: ignore[method-assign]
    try:
        rank, world = tdist.get_rank(), tdist.get_world_size()
        big = torch.randn(1020, 1024).chunk(world)[rank].clone()  # 3 equal row blocks
        distckpt.save({"big": ShardedTensor.from_rank_offsets("big", big, (0, rank, world))},
                      open_storage(location, ObjectStoreOptions(throttle_uploads=True)))
    finally:
        ObjectStoreStorage.upload_slot = original  # type: ignore[method-assign]


def test_throttled_uploads_do_not_overlap_on_one_host(dist, s3_server, tmp_path):
    log = tmp_path / "slots.log"
    url = f"s3://{s3_server.create_bucket()}/throttled"
    dist.run(3, _with_env, s3_server.env(), _throttled_save, url, str(log))
    spans = sorted(tuple(map(float, line.split()[1:])) for line in log.read_text().splitlines())
    assert len(spans) == 3
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end, spans  # one rank of this host uploads at a time
