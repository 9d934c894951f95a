"""Golden checkpoints committed under tests/golden/v<version> (format versions 1 and 2) must stay
readable, and the writer must keep producing the same data-file bytes for the same input."""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest
import torch
import torch.distributed as tdist

import distckpt
from distckpt.cli import main as cli_main
from distckpt.engine.verify import verify_checkpoint

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "v1")
GOLDENS = {version: os.path.join(os.path.dirname(__file__), "golden", f"v{version}") for version in (1, 2)}
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "golden"))
from golden_content import DTYPES, G_SHARDS, NORM, OPT, G, W, grid_state, single_state, value  # noqa: E402


@pytest.mark.parametrize("version", [1, 2])
def test_single_golden_loads_bit_exact(version):
    path = os.path.join(GOLDENS[version], "single")
    loaded = distckpt.load(single_state(empty=True), path)
    for name in DTYPES:
        assert loaded[name].dtype == value(name).dtype
        assert torch.equal(loaded[name], value(name)), name
    assert loaded["obj"]["a"] == [1, 2] and torch.equal(loaded["obj"]["t"], torch.tensor([7]))
    assert loaded["common"] == {"iteration": 10, "name": "golden"}
    assert distckpt.load_content_metadata(path) == {"golden": "single"}
    assert verify_checkpoint(path).ok


def test_writer_output_is_byte_stable(tmp_path):
    distckpt.save(single_state(empty=False), tmp_path, content_metadata={"golden": "single"})
    (fresh,) = glob.glob(str(tmp_path / "data-*.safetensors"))
    (golden,) = glob.glob(os.path.join(GOLDEN, "single", "data-*.safetensors"))
    with open(fresh, "rb") as a, open(golden, "rb") as b:
        assert a.read() == b.read()
    (golden_v2,) = glob.glob(os.path.join(GOLDENS[2], "single", "data-*.safetensors"))
    with open(golden_v2, "rb") as b:  # format version 2 changed only the index
        assert open(fresh, "rb").read() == b.read()


def test_writer_index_is_byte_stable(tmp_path):
    # (the golden was written with 1 MiB checksum blocks, the default before 2026-11-23)
    strategy = distckpt.strategies.distckpt.DistCkptSaveShardedStrategy(block_bytes=1 << 20)
    distckpt.save(grid_state(empty=False), tmp_path, strategy, content_metadata={"golden": "grid"})
    golden = os.path.join(GOLDENS[2], "grid")
    fresh_id = distckpt.engine.checkpoint.CheckpointReader(tmp_path).metadata.save_id
    golden_id = distckpt.engine.checkpoint.CheckpointReader(golden).metadata.save_id
    (fresh,) = glob.glob(str(tmp_path / "index-*.json"))
    (expected,) = glob.glob(os.path.join(golden, "index-*.json"))
    with open(fresh) as a, open(expected) as b:
        assert a.read().replace(fresh_id, golden_id) == b.read()


@pytest.mark.parametrize("version", [1, 2])
def test_two_rank_golden_on_one_process(version):
    path = os.path.join(GOLDENS[version], "two_ranks")
    plain = distckpt.load_plain_tensors(path)
    assert torch.equal(plain["w"], W) and torch.equal(plain["opt"], OPT) and torch.equal(plain["norm"], NORM)
    assert distckpt.load_common_state_dict(path) == {"iteration": 20, "content_metadata": {"golden": "two_ranks"}}
    assert cli_main(["verify", path]) == 0


def load_two_rank_golden_as_columns(path: str) -> bool:
    rank = tdist.get_rank()
    # 3 ranks: w split by columns unevenly (2, 1, 1); opt as flat ranges of the whole tensor.
    starts, widths = [0, 2, 3], [2, 1, 1]
    w = torch.zeros(8, widths[rank])
    flat = [slice(0, 5), slice(5, 20), slice(20, 24)][rank]
    request = {
        "w": distckpt.ShardedTensor.from_global_offset("w", w, (8, 4), (0, starts[rank])),
        "opt": distckpt.ShardedTensor.from_rank_offsets_flat(
            "opt", torch.zeros(flat.stop - flat.start), (4, 6), flattened_range=flat),
        "norm": distckpt.ShardedTensor.from_rank_offsets("norm", torch.zeros(4), replica_id=rank),
    }
    out = distckpt.load(request, path)
    return (
        torch.equal(out["w"], W[:, starts[rank] : starts[rank] + widths[rank]])
        and torch.equal(out["opt"], OPT.reshape(-1)[flat])
        and torch.equal(out["norm"], NORM)
        and out["iteration"] == 20
    )


@pytest.mark.parametrize("version", [1, 2])
def test_two_rank_golden_resharded_to_three_ranks(dist, version):
    path = os.path.join(GOLDENS[version], "two_ranks")
    assert dist.run(3, load_two_rank_golden_as_columns, path) == [True] * 3


@pytest.mark.parametrize("version,name", [(1, "single"), (1, "two_ranks"), (2, "single"), (2, "two_ranks"),
                                          (2, "grid")])
def test_golden_metadata_fields(version, name):
    reader = distckpt.engine.checkpoint.CheckpointReader(os.path.join(GOLDENS[version], name))
    assert reader.metadata.version == version and reader.metadata.format == "distckpt"
    assert reader.metadata.world_size == (2 if name == "two_ranks" else 1)
    with open(os.path.join(reader.path, reader.metadata.index.file)) as f:
        assert json.load(f)["version"] == version


def test_grid_golden_loads_in_other_layouts():
    path = os.path.join(GOLDENS[2], "grid")
    entry = distckpt.engine.checkpoint.CheckpointReader(path).index.tensors["g"]
    assert entry.grid is not None and entry.num_chunks == G_SHARDS
    assert torch.equal(distckpt.load_plain_tensors(path)["g"], G)
    loaded = distckpt.load(grid_state(empty=True), path)  # the saved layout
    assert torch.equal(torch.cat([t for t in loaded["g"]]), G)
    columns = {"g": [distckpt.ShardedTensor.from_global_offset("g", torch.zeros(70, 1), (70, 3), (0, c))
                     for c in range(3)]}
    loaded = distckpt.load(columns, path)
    assert torch.equal(torch.cat(loaded["g"], dim=1), G)
    assert distckpt.load_content_metadata(path) == {"golden": "grid"}
    assert verify_checkpoint(path).ok and cli_main(["verify", path]) == 0
