"""Golden checkpoints of format v1 committed under tests/golden/v1 must stay readable, and the
writer must keep producing the same bytes for the same input."""

from __future__ import annotations

import glob
import os
import sys

import pytest
import torch
import torch.distributed as tdist

import distckpt
from distckpt.cli import main as cli_main
from distckpt.engine.verify import verify_checkpoint

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "v1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "golden"))
from golden_content import DTYPES, NORM, OPT, W, single_state, value  # noqa: E402


def test_single_golden_loads_bit_exact():
    path = os.path.join(GOLDEN, "single")
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


def test_two_rank_golden_on_one_process():
    path = os.path.join(GOLDEN, "two_ranks")
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


def test_two_rank_golden_resharded_to_three_ranks(dist):
    assert dist.run(3, load_two_rank_golden_as_columns, os.path.join(GOLDEN, "two_ranks")) == [True] * 3


@pytest.mark.parametrize("name", ["single", "two_ranks"])
def test_golden_metadata_fields(name):
    reader = distckpt.engine.checkpoint.CheckpointReader(os.path.join(GOLDEN, name))
    assert reader.metadata.version == 1 and reader.metadata.format == "distckpt"
    assert reader.metadata.world_size == (1 if name == "single" else 2)
