"""Planning and the engine without processes: random save and load layouts, checked against
slices of the full tensor (hypothesis), and the coverage checks' messages."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distckpt.engine.io import execute_reads, write_rank_files
from distckpt.engine.load import load_tensors
from distckpt.engine.save import build_index, describe_local
from distckpt.errors import ShardingValidationError
from distckpt.format.index import CheckpointIndex
from distckpt.planning.boxes import Box, flat_range_to_boxes
from distckpt.planning.coverage import check_exact_cover
from distckpt.planning.load_plan import plan_reads
from distckpt.planning.save_plan import plan_save
from distckpt.serialization import _describe_request
from distckpt.storage import MemoryStorage
from distckpt.validation import validate_sharding_integrity

from _layouts import full_tensor, make_sharded, random_layout, shard_of

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64,
          torch.int8, torch.uint8, torch.bool]


def save_in_memory(key, full, layout, block_bytes):
    """Run the save path of every simulated rank; return storage and parsed index."""
    storage = MemoryStorage()
    locals_ = []
    for rank_specs in layout:
        sts = [make_sharded(key, full, spec) for spec in rank_specs]
        locals_.append(describe_local(sts, [], lambda o: b""))
    all_tensors = [loc.tensors for loc in locals_]
    validate_sharding_integrity(all_tensors)
    plans = plan_save(all_tensors)
    written = [
        write_rank_files(storage, f"data-x-r{r}", plans[r].chunks, locals_[r].tensor_data, [], block_bytes,
                         file_count=1 + r % 2)
        for r in range(len(layout))
    ]
    index = build_index(all_tensors, written, block_bytes)
    # Round-trip through JSON so the parser is exercised on every example.
    return storage, CheckpointIndex.from_json(index.to_json(), "index.json")


def load_rank(storage, index, key, full, specs):
    requests = [make_sharded(key, full, spec, empty=True) for spec in specs]
    shards, _ = _describe_request(requests)
    reads = plan_reads(shards, index.tensors, index.block_bytes)
    execute_reads(storage, reads, [r.data for r in requests], [r.dtype for r in requests],
                  index.block_bytes, thread_count=2)
    return requests


@settings(max_examples=300, deadline=None)
@given(
    shape=st.lists(st.integers(1, 7), min_size=0, max_size=3).map(tuple),
    dtype=st.sampled_from(DTYPES),
    save_world=st.integers(1, 5),
    load_world=st.integers(1, 5),
    seed=st.integers(0, 2**32 - 1),
    block_bytes=st.sampled_from([4, 16, 1 << 20]),
)
def test_any_layout_loads_into_any_layout(shape, dtype, save_world, load_world, seed, block_bytes):
    rng = random.Random(seed)
    full = full_tensor(shape, dtype, seed % 1000)
    storage, index = save_in_memory("t", full, random_layout(rng, shape, save_world), block_bytes)
    total_stored = sum(c.nbytes for c in index.tensors["t"].chunks)
    assert total_stored == full.numel() * full.element_size()  # replicas written once
    for specs in random_layout(rng, shape, load_world):
        for spec, loaded in zip(specs, load_rank(storage, index, "t", full, specs)):
            assert torch.equal(loaded.data, shard_of(full, spec)), spec


def test_replicas_are_written_once_and_balanced():
    full = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    # 4 ranks all hold the same 4 row blocks (DP replicas); rank r is main of block r.
    layout = [[((2 * b, 0), (2, 8), None, int(b != r)) for b in range(4)] for r in range(4)]
    locals_ = [describe_local([make_sharded("t", full, s) for s in specs], [], bytes) for specs in layout]
    plans = plan_save([loc.tensors for loc in locals_])
    assert [p.nbytes for p in plans] == [64, 64, 64, 64]
    assert sorted(c.box.offset for p in plans for c in p.chunks) == [(0, 0), (2, 0), (4, 0), (6, 0)]


def test_flat_range_decomposition_is_small_and_exact():
    shape = (3, 4, 5)
    full = torch.arange(60).reshape(shape)
    pieces = flat_range_to_boxes(shape, 7, 53)
    assert len(pieces) <= 2 * len(shape) - 1
    got = torch.cat([full[tuple(slice(o, o + s) for o, s in zip(*p.box))].reshape(-1) for p in pieces])
    assert torch.equal(got, torch.arange(7, 53))


def test_overlap_is_named_with_region_and_ranks():
    message = check_exact_cover("w", (4, 4), [Box((0, 0), (3, 4)), Box((2, 0), (2, 4))], [0, 1])
    assert "'w'" in message and "[2:3, 0:4]" in message and "rank 0" in message and "rank 1" in message


def test_hole_is_named_with_region():
    message = check_exact_cover("w", (4, 4), [Box((0, 0), (2, 4)), Box((3, 0), (1, 4))], [0, 1])
    assert "4 elements are not covered" in message and "[2:3, 0:4]" in message


def test_validation_rejects_disagreeing_global_shapes():
    a = describe_local([make_sharded("w", torch.zeros(4, 4), ((0, 0), (2, 4), None, 0))], [], bytes)
    b = describe_local([make_sharded("w", torch.zeros(6, 4), ((2, 0), (4, 4), None, 0))], [], bytes)
    with pytest.raises(ShardingValidationError, match="global shape"):
        validate_sharding_integrity([a.tensors, b.tensors])


def test_reads_only_needed_rows():
    full = torch.arange(1024 * 64, dtype=torch.float32).reshape(1024, 64)
    layout = [[((0, 0), (1024, 64), None, 0)]]
    storage, index = save_in_memory("t", full, layout, block_bytes=4096)
    spec = ((256, 0), (256, 64), None, 0)
    request = make_sharded("t", full, spec, empty=True)
    shards, _ = _describe_request([request])
    reads = plan_reads(shards, index.tensors, index.block_bytes)
    stats = execute_reads(storage, reads, [request.data], [request.dtype], index.block_bytes)
    assert torch.equal(request.data, full[256:512])
    assert stats.bytes_read == 256 * 64 * 4  # aligned rows: exactly the bytes needed


def test_load_tensors_stages_non_contiguous_destinations(tmp_path):
    del tmp_path
    full = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    storage, index = save_in_memory("t", full, [[((0, 0), (3, 4), None, 0)]], 1 << 20)
    destination = torch.zeros(4, 3).t()  # non-contiguous view
    assert not destination.is_contiguous()
    request = make_sharded("t", full, ((0, 0), (3, 4), None, 0), empty=True)
    request.data = destination

    class Reader:  # the parts of CheckpointReader that load_tensors uses
        pass

    from types import SimpleNamespace

    reader = Reader()
    reader.index, reader.storage, reader.path = index, storage, "mem"
    reader.metadata = SimpleNamespace(save_id="x", index=SimpleNamespace(crc32c=0))
    load_tensors(reader, [request])
    assert torch.equal(destination, full)


def test_adjacent_chunks_are_read_in_one_request():
    storage = MemoryStorage()
    fulls = {f"t{i:02d}": torch.arange(32, dtype=torch.float32).reshape(4, 8) + 100 * i for i in range(20)}
    locals_ = describe_local([make_sharded(k, v, ((0, 0), (4, 8), None, 0)) for k, v in fulls.items()], [], bytes)
    plans = plan_save([locals_.tensors])
    written = [write_rank_files(storage, "data-x-r0", plans[0].chunks, locals_.tensor_data, [], 1 << 20)]
    index = build_index([locals_.tensors], written, 1 << 20)
    # Column halves: no chunk lines up with its destination, so every read is buffered.
    requests = [make_sharded(k, v, ((0, 4), (4, 4), None, 0), empty=True) for k, v in fulls.items()]
    shards, _ = _describe_request(requests)
    reads = plan_reads(shards, index.tensors, index.block_bytes)
    stats = execute_reads(storage, reads, [r.data for r in requests], [r.dtype for r in requests], index.block_bytes)
    assert stats.requests == 1 and stats.coalesced_reads == 19 and stats.chunks_read == 20
    assert stats.bytes_read == 20 * 4 * 8 * 4
    for request, full in zip(requests, fulls.values()):
        assert torch.equal(request.data, full[:, 4:])
