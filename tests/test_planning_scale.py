"""The fast paths of planning at scale against their slow references, and index version 2.

- coverage: the regular-grid recognition (find_overlap, covers_exactly, check_exact_cover)
  against the pairwise sweep and the original exact-cover check;
- validation and plan_save against literal implementations of their specification;
- the index: grids round-trip, version 1 documents still parse to the same chunks, chunk
  lookup by bisection finds exactly the overlapping chunks, and damaged grids are refused.
"""

from __future__ import annotations

import base64
import gc
import itertools
import json
import math
import random
import zlib
from collections import defaultdict
from importlib import resources

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from distckpt.errors import CheckpointingException, CorruptCheckpointError, ShardingValidationError
from distckpt.format.index import CheckpointIndex, ChunkEntry, TensorEntry, pack_ints
from distckpt.planning.boxes import Box, intersect
from distckpt.planning.columns import shard_columns
from distckpt.planning.coverage import (
    check_exact_cover,
    covers_exactly,
    find_hole,
    find_overlap,
    find_overlap_sweep,
    regular_grid,
)
from distckpt.planning.gcpause import paused_gc
from distckpt.planning.load_plan import plan_reads
from distckpt.planning.save_plan import plan_save, plan_save_reference
from distckpt.planning.shards import ObjectShard, TensorShard
from distckpt.validation import validate_sharding_integrity

# ---------------------------------------------------------------------------------------------
# Random boxes: grids, perturbed


def grid_boxes(rng: random.Random, shape: tuple[int, ...]) -> list[Box]:
    cuts = [[0, *sorted(rng.sample(range(1, n), rng.randint(0, min(4, n - 1)))), n] if n > 1 else [0, n]
            for n in shape]
    return [Box(tuple(c[i] for c, i in zip(cuts, cell)), tuple(c[i + 1] - c[i] for c, i in zip(cuts, cell)))
            for cell in itertools.product(*[range(len(c) - 1) for c in cuts])]


def perturb(rng: random.Random, shape: tuple[int, ...], boxes: list[Box]) -> list[Box]:
    boxes = list(boxes)
    for _ in range(rng.randint(0, 2)):
        choice = rng.randrange(7)
        if choice == 0 and boxes:
            boxes.pop(rng.randrange(len(boxes)))  # a hole
        elif choice == 1 and boxes:
            boxes.append(rng.choice(boxes))  # a duplicate
        elif choice == 2 and boxes and shape:  # split a box in two along an axis (still exact)
            b = boxes.pop(rng.randrange(len(boxes)))
            axis = rng.randrange(len(shape))
            if b.shape[axis] > 1:
                cut = rng.randint(1, b.shape[axis] - 1)
                lo = Box(b.offset, tuple(cut if a == axis else s for a, s in enumerate(b.shape)))
                hi = Box(tuple(o + cut if a == axis else o for a, o in enumerate(b.offset)),
                         tuple(s - cut if a == axis else s for a, s in enumerate(b.shape)))
                boxes += [lo, hi]
            else:
                boxes.append(b)
        elif choice == 3 and shape:  # an empty box somewhere
            offset = tuple(rng.randint(0, n) for n in shape)
            axis = rng.randrange(len(shape))
            boxes.append(Box(offset, tuple(0 if a == axis else rng.randint(0, n - o)
                                           for a, (o, n) in enumerate(zip(offset, shape)))))
        elif choice == 4 and boxes:  # grow a box by one along an axis (overlap or outside)
            i = rng.randrange(len(boxes))
            b = boxes[i]
            if shape:
                axis = rng.randrange(len(shape))
                boxes[i] = Box(b.offset, tuple(s + 1 if a == axis else s for a, s in enumerate(b.shape)))
        elif choice == 5:
            rng.shuffle(boxes)
    return boxes


def reference_exact_cover(key, global_shape, boxes, owners):
    """check_exact_cover before the fast path (message for message)."""
    numel = math.prod(global_shape)
    overlap = find_overlap_sweep(boxes)
    if overlap is not None:
        i, j, common = overlap
        return (
            f"tensor {key!r}: region {common.describe()} is covered by more than one main "
            f"replica (rank {owners[i]} box {boxes[i].describe()} and rank {owners[j]} box "
            f"{boxes[j].describe()}); give all but one of them a non-zero replica_id"
        )
    covered = sum(b.volume for b in boxes)
    if covered != numel:
        hole = find_hole(global_shape, boxes)
        where = f"region {hole.describe()}" if hole is not None else "some region"
        return (
            f"tensor {key!r} of global shape {tuple(global_shape)}: {numel - covered} elements are "
            f"not covered by any main replica ({where} is missing); check the global offsets, "
            "or mark one holder of each shard with replica_id 0"
        )
    return None


def brute_force_cover(shape, boxes) -> bool:
    counts: dict[tuple, int] = defaultdict(int)
    for b in boxes:
        for cell in itertools.product(*[range(o, o + s) for o, s in zip(b.offset, b.shape)]):
            counts[cell] += 1
    inside = set(itertools.product(*[range(n) for n in shape]))
    return set(counts) == inside and all(v == 1 for v in counts.values())


@settings(max_examples=500, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple), seed=st.integers(0, 2**32 - 1))
def test_coverage_fast_paths_agree_with_the_sweep(shape, seed):
    rng = random.Random(seed)
    boxes = perturb(rng, shape, grid_boxes(rng, shape))
    owners = [rng.randrange(4) for _ in boxes]
    assert (find_overlap(boxes) is None) == (find_overlap_sweep(boxes) is None)
    if find_overlap(boxes) is not None:
        assert find_overlap(boxes) == find_overlap_sweep(boxes)
    if regular_grid([b for b in boxes if b.volume]) is not None:
        assert find_overlap_sweep(boxes) is None
    if covers_exactly(shape, boxes):
        assert brute_force_cover(shape, boxes)
    assert check_exact_cover("t", shape, boxes, owners) == reference_exact_cover("t", shape, boxes, owners)
    inside = all(o + s <= n for b in boxes for o, s, n in zip(b.offset, b.shape, shape))
    if inside:  # (boxes outside the tensor are refused earlier, when shards are described)
        assert (check_exact_cover("t", shape, boxes, owners) is None) == brute_force_cover(shape, boxes)


def test_row_split_with_empty_shards_is_recognised():
    # FSDP style: 5 rows over 4 ranks in chunks of 2 -> rows 0:2, 2:4, 4:5 and an empty shard.
    boxes = [Box((0, 0), (2, 3)), Box((2, 0), (2, 3)), Box((4, 0), (1, 3)), Box((5, 0), (0, 3))]
    assert covers_exactly((5, 3), boxes)
    assert regular_grid(boxes[:3]) == [[0, 2, 4, 5], [0, 3]]
    assert not covers_exactly((6, 3), boxes)
    assert regular_grid([Box((0,), (2,)), Box((1,), (2,))]) is None  # overlap


# ---------------------------------------------------------------------------------------------
# Validation and plan_save against references


def reference_validate(all_tensors):
    """validate_sharding_integrity before the fast path (tensors only)."""
    by_key = defaultdict(list)
    for rank, shards in enumerate(all_tensors):
        for shard in shards:
            by_key[shard.key].append((rank, shard))
    problems = []
    for key, holders in sorted(by_key.items()):
        rank0, first = holders[0]
        for rank, shard in holders[1:]:
            if (shard.global_shape, shard.dtype) != (first.global_shape, first.dtype):
                problems.append(
                    f"tensor {key!r}: rank {rank0} says global shape {first.global_shape} "
                    f"{first.dtype}, rank {rank} says {shard.global_shape} {shard.dtype}"
                )
                break
        else:
            boxes, owners = [], []
            for rank, shard in holders:
                if shard.main:
                    for piece in shard.pieces():
                        boxes.append(piece.box)
                        owners.append(rank)
            message = reference_exact_cover(key, first.global_shape, boxes, owners)
            if message:
                problems.append(message)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        return "invalid sharding: " + problems[0] + more
    return None


def random_world(rng: random.Random, ranks: int, keys: int, errors: bool, flats: bool = True,
                 shuffle: bool = True):
    """Shard descriptions of ``ranks`` ranks: grids, replicas, flat ranges, empty shards,
    equal sizes; with ``errors``, also holes, overlaps and disagreeing shapes."""
    world: list[list[TensorShard]] = [[] for _ in range(ranks)]
    for k in range(keys):
        key = f"t{k}"
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        dtype, size = rng.choice([("float32", 4), ("bfloat16", 2)])
        boxes = grid_boxes(rng, shape)
        if errors and rng.random() < 0.3:
            boxes = perturb(rng, shape, boxes)
        for box in boxes:
            numel = box.volume
            flats: list = [None]
            if flats and numel > 2 and rng.random() < 0.25:
                cut = rng.randint(1, numel - 1)
                flats = [(0, cut), (cut, numel)]
            for flat in flats:
                owner = rng.randrange(ranks)
                gshape = shape
                if errors and rng.random() < 0.02:
                    gshape = shape + (1,)
                world[owner].append(TensorShard(key, dtype, size, gshape, box, flat, True))
                for other in rng.sample(range(ranks), rng.randint(0, ranks - 1)):
                    world[other].append(TensorShard(key, dtype, size, gshape, box, flat, False))
        if shape and rng.random() < 0.3:  # empty shards, as FSDP leaves on trailing ranks
            empty = Box((shape[0],) + (0,) * (len(shape) - 1), (0,) + shape[1:])
            for r in rng.sample(range(ranks), rng.randint(1, ranks)):
                world[r].append(TensorShard(key, dtype, size, shape, empty, None, rng.random() < 0.5))
        if rng.random() < 0.1:  # a shard nobody holds as main: not written
            for r in rng.sample(range(ranks), rng.randint(1, ranks)):
                world[r].append(TensorShard(f"x{k}", dtype, size, (3,), Box((0,), (3,)), None, False))
    for shards in world:
        if shuffle:
            rng.shuffle(shards)
        else:
            shards.sort(key=lambda s: s.key)
    objects: list[list[ObjectShard]] = [[] for _ in range(ranks)]
    for o in range(rng.randint(0, 3)):
        for r in rng.sample(range(ranks), rng.randint(1, ranks)):
            objects[r].append(ObjectShard(f"o{o}/shard_0_1", f"o{o}", (1,), (0,), rng.choice([4, 8, 12]),
                                          rng.random() < 0.6))
    return world, objects


@settings(max_examples=400, deadline=None)
@given(ranks=st.integers(1, 6), keys=st.integers(1, 6), seed=st.integers(0, 2**32 - 1),
       errors=st.booleans(), flats=st.booleans(), shuffle=st.booleans())
def test_validation_agrees_with_its_reference(ranks, keys, seed, errors, flats, shuffle):
    world, _ = random_world(random.Random(seed), ranks, keys, errors, flats, shuffle)
    expected = reference_validate(world)
    try:
        validate_sharding_integrity(world)
    except ShardingValidationError as exc:
        assert str(exc) == expected
    else:
        assert expected is None


@settings(max_examples=400, deadline=None)
@given(ranks=st.integers(1, 6), keys=st.integers(1, 6), seed=st.integers(0, 2**32 - 1),
       errors=st.booleans(), flats=st.booleans(), shuffle=st.booleans())
def test_plan_save_agrees_with_the_greedy(ranks, keys, seed, errors, flats, shuffle):
    world, objects = random_world(random.Random(seed), ranks, keys, errors, flats, shuffle)
    fast = plan_save(world, objects)
    slow = plan_save_reference(world, objects)
    assert [(p.chunks, p.objects, p.nbytes) for p in fast] == [(p.chunks, p.objects, p.nbytes) for p in slow]


def fsdp_world(ranks: int, shapes: list[tuple[int, ...]]) -> list[list[TensorShard]]:
    """Every tensor's rows split over all ranks in chunks of ceil(rows / ranks), as FSDP2 does."""
    world = []
    for rank in range(ranks):
        local = []
        for k, shape in enumerate(shapes):
            step = -(-shape[0] // ranks)
            start = min(rank * step, shape[0])
            stop = min(start + step, shape[0])
            local.append(TensorShard(f"w{k}", "bfloat16", 2, shape, Box((start,) + (0,) * (len(shape) - 1),
                                                                        (stop - start,) + shape[1:])))
        world.append(local)
    return world


def test_fsdp_layout_takes_the_column_path():
    world = fsdp_world(7, [(5, 3), (20,), (7, 2, 2), (3, 4)])
    columns = shard_columns(world)
    assert columns is not None and len(columns.groups) == 1
    validate_sharding_integrity(world)
    assert reference_validate(world) is None
    fast, slow = plan_save(world), plan_save_reference(world)
    assert [(p.chunks, p.objects, p.nbytes) for p in fast] == [(p.chunks, p.objects, p.nbytes) for p in slow]
    world[3][1] = TensorShard("w1", "bfloat16", 2, (20,), Box((0,), (3,)))  # overlaps rank 0's rows
    with pytest.raises(ShardingValidationError) as raised:
        validate_sharding_integrity(world)
    assert str(raised.value) == reference_validate(world)


def test_plan_save_balances_equal_sizes_like_the_greedy():
    # Every rank holds a replica of every shard, all of one size; single-holder shards too.
    box = Box((0,), (4,))
    world = [[TensorShard(f"k{i}", "float32", 4, (4,), box, None, r == 0) for i in range(5)]
             + [TensorShard(f"solo{r}", "float32", 4, (4,), box)] for r in range(3)]
    fast, slow = plan_save(world), plan_save_reference(world)
    assert [(p.chunks, p.nbytes) for p in fast] == [(p.chunks, p.nbytes) for p in slow]
    assert sorted(p.nbytes for p in fast) == [32, 48, 48]


def test_gc_pause_nests_and_restores():
    assert gc.isenabled()
    with paused_gc():
        assert not gc.isenabled()
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


# ---------------------------------------------------------------------------------------------
# Index version 2


def make_index(rng: random.Random, shape, boxes, block_bytes=8, itemsize=4, dtype="float32") -> CheckpointIndex:
    index = CheckpointIndex(block_bytes=block_bytes)
    entry = index.tensors["t"] = TensorEntry(dtype, shape)
    files = [f"data-r{r}-0.safetensors" for r in range(3)]
    position = dict.fromkeys(files, 64)
    for box in boxes:
        name = rng.choice(files)
        nbytes = box.volume * itemsize
        crcs = tuple(rng.getrandbits(32) for _ in range(-(-nbytes // block_bytes)))
        entry.chunks.append(ChunkEntry(box.offset, box.shape, name, position[name], nbytes, crcs))
        position[name] += nbytes
    return index


def v1_document(raw: bytes) -> bytes:
    """The same index written as version 1 (every chunk listed)."""
    doc = json.loads(raw)
    parsed = CheckpointIndex.from_json(raw, "v2")
    doc["version"] = 1
    for key, t in doc["tensors"].items():
        if t.pop("grid", None) is not None:
            t["chunks"] = [
                {"offset": list(c.offset), "shape": list(c.shape), "file": doc["files"].index(c.file),
                 "data_offset": c.data_offset, "nbytes": c.nbytes, "crc32c": list(c.crc32c)}
                for c in parsed.tensors[key].chunks
            ]
    return json.dumps(doc).encode()


def schema(name: str) -> Draft202012Validator:
    return Draft202012Validator(json.loads(resources.files("distckpt.format").joinpath(name).read_text()))


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 40), min_size=0, max_size=3).map(tuple), seed=st.integers(0, 2**32 - 1),
       block_bytes=st.sampled_from([4, 8, 64, 1 << 20]))
def test_index_round_trip_and_lookup(shape, seed, block_bytes):
    rng = random.Random(seed)
    boxes = grid_boxes(rng, shape)
    if rng.random() < 0.3:  # split a cell: no longer a grid
        boxes = perturb(random.Random(seed + 1), shape, boxes)
        if find_overlap_sweep(boxes) is not None or any(
            o + s > n for b in boxes for o, s, n in zip(b.offset, b.shape, shape)
        ):
            return
    if shape and rng.random() < 0.3:
        boxes.append(Box((shape[0],) + (0,) * (len(shape) - 1), (0,) + shape[1:]))
    index = make_index(rng, shape, boxes, block_bytes)
    raw = index.to_json()
    doc = json.loads(raw)
    schema("index.schema.json").validate(doc)
    parsed = CheckpointIndex.from_json(raw, "index")
    old = CheckpointIndex.from_json(v1_document(raw), "index")
    expected = sorted(index.tensors["t"].chunks, key=lambda c: (c.offset, c.shape))
    for version in (parsed, old):
        entry = version.tensors["t"]
        for _ in range(5):  # lookup of random boxes (before materializing the chunk list)
            offset = tuple(rng.randint(0, n) for n in shape)
            box = Box(offset, tuple(rng.randint(0, n - o) for o, n in zip(offset, shape)))
            found = {(c.offset, c.shape) for c in entry.overlapping(box) if intersect(box, Box(c.offset, c.shape))}
            truth = {(c.offset, c.shape) for c in expected if intersect(box, Box(c.offset, c.shape))}
            assert found == truth
        assert entry.num_chunks == len(expected)
        assert sorted(entry.chunks, key=lambda c: (c.offset, c.shape)) == expected
        assert version.files == index.files
    live = [b for b in boxes if b.volume]
    assert ("grid" in doc["tensors"]["t"]) == (len(live) >= 2 and covers_exactly(shape, live))
    # An index parsed from version 2 writes the same document again (grids kept compact).
    assert CheckpointIndex.from_json(raw, "i").to_json() == raw


def test_row_split_over_many_ranks_is_small():
    rows, ranks = 11008, 4096
    step = -(-rows // ranks)
    index = CheckpointIndex()
    entry = index.tensors["t"] = TensorEntry("bfloat16", (rows, 64))
    for r in range(ranks):  # rank r writes rows r*step.. into its own file, after its header
        start = min(r * step, rows)
        box = Box((start, 0), (min(step, rows - start), 64))
        entry.chunks.append(ChunkEntry(box.offset, box.shape, f"data-r{r:05d}-0.safetensors",
                                       4096 + 8 * (r % 3), box.volume * 2, (r * 7919 % 2**32,) if box.volume else ()))
    raw = index.to_json()
    grid = json.loads(raw)["tensors"]["t"]["grid"]
    assert grid["crc32c"]["dtype"] == "uint32" and grid["cuts"][0]["zlib"] and grid["file"]["delta"]
    assert len(json.dumps(grid)) < 7 * ranks  # the crc32c values in base64 (5.3 bytes each), little else
    parsed = CheckpointIndex.from_json(raw, "index").tensors["t"]
    assert parsed.grid is not None and parsed.chunks == entry.chunks


def test_packed_arrays_round_trip():
    for values in ([0] * 20, list(range(100)), [5, -3, 2**40, 0] * 10, [2**62] * 9, [0, 255, 256, 65536] * 5):
        for delta, compress in itertools.product([False, True], repeat=2):
            packed = pack_ints(values, delta=delta, compress=compress)
            assert isinstance(packed, dict) and packed["count"] == len(values)
            raw = base64.b64decode(packed["data"])
            if compress:
                raw = zlib.decompress(raw)
            width = {"uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "uint32": 4, "int32": 4,
                     "uint64": 8, "int64": 8}[packed["dtype"]]
            stored = [int.from_bytes(raw[i : i + width], "little", signed=packed["dtype"].startswith("int"))
                      for i in range(0, len(raw), width)]
            assert (list(itertools.accumulate(stored)) if delta else stored) == values
    assert pack_ints([1, 2, 3]) == [1, 2, 3]


def grid_document():
    rng = random.Random(1)
    boxes = [Box((r * 3, 0), (3, 4)) for r in range(12)] + [Box((36, 0), (0, 4))]
    return json.loads(make_index(rng, (36, 4), boxes, block_bytes=16).to_json())


def _packed(values, dtype, **extra):
    import array

    code = {"uint8": "B", "int64": "q", "uint32": "I", "uint16": "H"}[dtype]
    raw = array.array(code, values).tobytes()
    if extra.get("zlib"):
        raw = zlib.compress(raw)
    return {"dtype": dtype, "count": len(values), **extra, "data": base64.b64encode(raw).decode()}


def _corruptions():
    def cut(g):
        g["cuts"][0] = [0, 3, 3, 36]

    def cut_range(g):
        g["cuts"][1] = [0, 5]

    def axes(g):
        g["cuts"].append([0, 1])

    def file_range(g):
        g["file"] = [7] * 12

    def file_count(g):
        g["file"] = [0] * 11

    def packed_count(g):
        g["data_offset"] = _packed([64] * 11, "int64")

    def bomb(g):  # a small stream claiming many values
        g["data_offset"] = _packed([0] * 5_000_000, "uint8", zlib=True)

    def bad_base64(g):
        g["data_offset"] = {"dtype": "uint16", "count": 12, "data": "!!!!"}

    def trailing(g):
        packed = _packed([64] * 12, "uint16", zlib=True)
        packed["data"] = base64.b64encode(base64.b64decode(packed["data"]) + b"x").decode()
        g["data_offset"] = packed

    def crc_count(g):
        g["crc32c"] = g["crc32c"][:-1] if isinstance(g["crc32c"], list) else _packed([1] * 23, "uint32")

    def crc_compressed(g):
        g["crc32c"] = _packed([1] * 24, "uint32", zlib=True)

    def crc_type(g):
        g["crc32c"] = _packed([1] * 24, "int64")

    def offset_range(g):
        g["data_offset"] = _packed([2**63 - 1] * 12, "int64")

    def negative(g):
        g["data_offset"] = _packed([-1] * 12, "int64")

    def dtype(g):
        g["file"] = {"dtype": "float32", "count": 12, "data": ""}

    return [cut, cut_range, axes, file_range, file_count, packed_count, bomb, bad_base64, trailing,
            crc_count, crc_compressed, crc_type, offset_range, negative, dtype]


@pytest.mark.parametrize("corrupt", _corruptions(), ids=lambda f: f.__name__)
def test_damaged_grids_are_refused(corrupt):
    doc = grid_document()
    CheckpointIndex.from_json(json.dumps(doc).encode(), "index")
    corrupt(doc["tensors"]["t"]["grid"])
    with pytest.raises(CorruptCheckpointError, match="grid"):
        CheckpointIndex.from_json(json.dumps(doc).encode(), "index")


def test_grid_with_listed_chunks_holding_elements_is_refused():
    doc = grid_document()
    chunks = doc["tensors"]["t"]["chunks"]
    chunks.append(dict(chunks[0], offset=[0, 0], shape=[1, 4], nbytes=16, crc32c=[1]))
    with pytest.raises(CorruptCheckpointError, match="only chunks without elements"):
        CheckpointIndex.from_json(json.dumps(doc).encode(), "index")


def test_plain_grid_arrays_are_read():
    doc = grid_document()
    parsed = CheckpointIndex.from_json(json.dumps(doc).encode(), "index").tensors["t"].chunks
    grid = doc["tensors"]["t"]["grid"]
    grid["cuts"] = [list(range(0, 37, 3)), [0, 4]]
    files = json.loads(json.dumps(doc))["files"]
    grid["file"] = [files.index(c.file) for c in parsed if c.nbytes]
    grid["data_offset"] = [c.data_offset for c in parsed if c.nbytes]
    schema("index.schema.json").validate(doc)
    again = CheckpointIndex.from_json(json.dumps(doc).encode(), "index").tensors["t"].chunks
    assert again == parsed


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(st.tuples(st.integers(0, 10_000), st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.text(max_size=12),
    st.lists(st.integers(-5, 2**40), max_size=4), st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)), min_size=1, max_size=3))
def test_grid_reader_only_raises_library_errors(mutations):
    doc = grid_document()
    for pick, value in mutations:
        paths = [p for p in _paths(doc) if p]
        path = paths[pick % len(paths)]
        target = doc
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
    try:
        index = CheckpointIndex.from_json(json.dumps(doc).encode(), "index")
    except CheckpointingException:
        return
    for entry in index.tensors.values():  # what parses is usable
        entry.overlapping(Box((0,) * len(entry.shape), entry.shape))
        assert entry.num_chunks == len(entry.chunks)


def test_plan_reads_on_a_grid_matches_listed_chunks():
    rng = random.Random(3)
    boxes = [Box((r * 5, c * 4), (5, 4)) for r in range(6) for c in range(2)]
    raw = make_index(rng, (30, 8), boxes, block_bytes=16).to_json()
    grid, listed = CheckpointIndex.from_json(raw, "a"), CheckpointIndex.from_json(v1_document(raw), "b")
    assert grid.tensors["t"].grid is not None and listed.tensors["t"].grid is None
    requests = [TensorShard("t", "float32", 4, (30, 8), Box((7, 1), (11, 6))),
                TensorShard("t", "float32", 4, (30, 8), Box((0, 0), (30, 8)), (13, 170))]
    a = plan_reads(requests, grid.tensors, 16)
    b = plan_reads(requests, listed.tensors, 16)
    assert [(r.chunk, r.copies, r.read_start, r.read_stop) for r in a] == \
        [(r.chunk, r.copies, r.read_start, r.read_stop) for r in b]


@settings(max_examples=100, deadline=None)
@given(ranks=st.integers(1, 9), seed=st.integers(0, 2**32 - 1), block_bytes=st.sampled_from([4, 64, 1 << 20]))
def test_index_of_many_tensors_is_written_the_same_position_by_position(ranks, seed, block_bytes):
    from distckpt.engine.save import build_index
    from distckpt.format import index as index_module

    rng = random.Random(seed)
    shapes = [tuple(rng.randint(1, 12) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 6))]
    world = fsdp_world(ranks, shapes)
    plans = plan_save(world)
    written = []
    for rank, plan in enumerate(plans):
        position = 8 * rank + 16
        records = []
        for write in plan.chunks:
            nbytes = write.box.volume * 2
            records.append((write.key, ChunkEntry(write.box.offset, write.box.shape, f"data-r{rank}.safetensors",
                                                  position, nbytes,
                                                  tuple(rng.getrandbits(32) for _ in range(-(-nbytes // block_bytes))))))
            position += nbytes
        written.append((records, []))
    index = build_index(world, written, block_bytes)
    if rng.random() < 0.3:  # a chunk list out of order: the position-major path must step aside
        entry = rng.choice(list(index.tensors.values()))
        entry.chunks.reverse()
    raw = index.to_json()
    original = index_module._ChunkColumns.read
    index_module._ChunkColumns.read = classmethod(lambda cls, index: [])  # type: ignore[assignment]
    try:
        assert index.to_json() == raw
    finally:
        index_module._ChunkColumns.read = original  # type: ignore[assignment]
    parsed = CheckpointIndex.from_json(raw, "index")
    for key, entry in index.tensors.items():
        assert sorted(parsed.tensors[key].chunks, key=lambda c: (c.offset, c.shape)) == \
            sorted(entry.chunks, key=lambda c: (c.offset, c.shape))


def test_columns_kept_by_validation_serve_only_the_same_shards():
    world = fsdp_world(5, [(9, 2), (4,)])
    validate_sharding_integrity(world)
    first = plan_save(world)  # takes the columns validation kept
    validate_sharding_integrity(world)
    world[2][0] = TensorShard("w0", "bfloat16", 2, (9, 2), Box((4, 0), (2, 2)), None, False)  # a replica now
    world[1][0] = TensorShard("w0", "bfloat16", 2, (9, 2), Box((2, 0), (4, 0)), None, True)
    assert plan_save(world) == plan_save_reference(world) != first
    assert first == plan_save_reference(fsdp_world(5, [(9, 2), (4,)]))
