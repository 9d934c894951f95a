"""Save and load in one process (no torch.distributed): API semantics, bad input, CLI."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import distckpt
from distckpt import (
    LocalNonPersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    StrictHandling,
)
from distckpt.cli import main as cli_main
from distckpt.errors import (
    CheckpointExistsError,
    CheckpointingException,
    CheckpointNotFoundError,
    ChecksumError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MismatchError,
    MissingKeyError,
    ShardingValidationError,
    StorageError,
    UnsafeCheckpointError,
)

ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
              torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]


def values(dtype, shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100, 100, shape, generator=gen).to(dtype)


def model_state(w=None):
    w = values(torch.float32, (8, 6)) if w is None else w
    return {
        "w": ShardedTensor.from_rank_offsets("w", w),
        "layer": {"b": ShardedTensor.from_rank_offsets("b", torch.arange(6.0))},
        "step": 7,
        "args": {"lr": 0.1, "names": ["a", "b"]},
        "rng": ShardedObject("rng", torch.tensor([1, 2, 3]), (1,), (0,)),
    }


def request(w_shape=(8, 6), dtype=torch.float32):
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.zeros(w_shape, dtype=dtype)),
        "layer": {"b": ShardedTensor.from_rank_offsets("b", torch.zeros(6))},
        "rng": ShardedObject("rng", None, (1,), (0,)),
    }


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt"
    distckpt.save(model_state(), path)
    return path


def test_round_trip_restores_everything(ckpt):
    loaded = distckpt.load(request(), ckpt)
    assert torch.equal(loaded["w"], values(torch.float32, (8, 6)))
    assert torch.equal(loaded["layer"]["b"], torch.arange(6.0))
    assert loaded["step"] == 7 and loaded["args"] == {"lr": 0.1, "names": ["a", "b"]}
    assert torch.equal(loaded["rng"], torch.tensor([1, 2, 3]))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_dtypes_round_trip_bit_exact(tmp_path, dtype):
    full = values(dtype, (5, 7), seed=3)
    distckpt.save({"t": ShardedTensor.from_rank_offsets("t", full)}, tmp_path)
    part = ShardedTensor.from_global_offset("t", torch.zeros_like(full[1:3]), (5, 7), (1, 0))
    out = distckpt.load({"t": part}, tmp_path, validate_access_integrity=False)
    assert out["t"].dtype == dtype
    assert torch.equal(out["t"].view(torch.uint8), full[1:3].contiguous().view(torch.uint8))


def test_data_files_are_valid_safetensors(ckpt):
    (data_file,) = glob.glob(str(ckpt / "data-*.safetensors"))
    tensors = load_file(data_file)
    assert torch.equal(tensors["w@0,0"], values(torch.float32, (8, 6)))
    assert "__object__/rng/shard_0_1" in tensors


def test_metadata_json_is_the_commit_marker(ckpt):
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["format"] == "distckpt" and meta["version"] == 2
    assert meta["sharded_backend"] == "distckpt" and meta["common_backend"] == "torch"
    assert (ckpt / meta["index"]["file"]).exists() and (ckpt / meta["common"]["file"]).exists()


def test_factories_and_nonpersistent_objects(tmp_path):
    def build(key, data, replica_id, flattened_range):
        return {"half1": ShardedTensor.from_rank_offsets(f"{key}.1", data[:2].clone()),
                "half2": ShardedTensor.from_rank_offsets(f"{key}.2", data[2:].clone())}

    def merge(sub):
        return torch.cat([sub["half1"], sub["half2"]])

    data = torch.arange(8.0).reshape(4, 2)
    state = {"f": ShardedTensorFactory("fac", data, build, merge), "live": LocalNonPersistentObject("x")}
    distckpt.save(state, tmp_path)
    assert set(distckpt.load_tensors_metadata(tmp_path)) == {"fac.1", "fac.2"}
    assert "live" not in distckpt.load_common_state_dict(tmp_path)
    req = {"f": ShardedTensorFactory("fac", torch.zeros(4, 2), build, merge),
           "live": LocalNonPersistentObject({"handle": 1})}
    loaded = distckpt.load(req, tmp_path)
    assert torch.equal(loaded["f"], data) and loaded["live"] == {"handle": 1}


def test_metadata_functions(ckpt):
    meta = distckpt.load_tensors_metadata(ckpt)
    assert set(meta) == {"w", "b"}
    assert meta["w"].global_shape == (8, 6) and meta["w"].dtype == torch.float32
    assert meta["w"].data.device.type == "meta"
    sharded = distckpt.load_sharded_metadata(ckpt)
    assert isinstance(sharded["rng/shard_0_1"], ShardedObject)
    plain = distckpt.load_plain_tensors(ckpt)
    assert set(plain) == {"w", "b"} and torch.equal(plain["b"], torch.arange(6.0))
    assert distckpt.load_common_state_dict(ckpt) == {"step": 7, "args": {"lr": 0.1, "names": ["a", "b"]}}


def test_content_metadata(tmp_path):
    distckpt.save(model_state(), tmp_path, content_metadata={"format": "mcore", "step": 3})
    assert distckpt.load_content_metadata(tmp_path) == {"format": "mcore", "step": 3}
    loaded = distckpt.load(request(), tmp_path)
    assert distckpt.load_content_metadata(preloaded_state_dict=loaded) == {"format": "mcore", "step": 3}
    with pytest.raises(CheckpointingException, match="JSON"):
        distckpt.save(model_state(), tmp_path / "x", content_metadata={"obj": object()})
    for bad in ({2: "a", 10: "b"}, {"x": float("nan")}, {"t": (1, 2)}):
        with pytest.raises(CheckpointingException, match="JSON"):
            distckpt.save(model_state(), tmp_path / "y", content_metadata=bad)


def test_remove_sharded_tensors(ckpt):
    distckpt.remove_sharded_tensors(ckpt, "w")
    assert set(distckpt.load_tensors_metadata(ckpt)) == {"b"}
    out = distckpt.load({"b": ShardedTensor.from_rank_offsets("b", torch.zeros(6))}, ckpt)
    assert torch.equal(out["b"], torch.arange(6.0))
    assert cli_main(["verify", str(ckpt)]) == 0


def test_default_strategies():
    save_strategy = distckpt.get_default_save_sharded_strategy()
    assert (save_strategy.backend, save_strategy.version) == ("distckpt", 1)
    assert distckpt.get_default_save_common_strategy().backend == "torch"
    with pytest.raises(CheckpointingException, match="torch_dist"):
        distckpt.get_default_save_sharded_strategy("torch_dist", 1)


def test_default_load_strategy_and_tuple_strategies(tmp_path):
    distckpt.save(model_state(), tmp_path, sharded_strategy=("distckpt", 1), common_strategy=("torch", 1))
    assert distckpt.get_default_load_sharded_strategy(tmp_path).backend == "distckpt"
    out = distckpt.load(request(), tmp_path, sharded_strategy=("distckpt", 1))
    assert out["step"] == 7


def test_thread_count_writes_several_files(tmp_path):
    from distckpt.strategies import DistCkptLoadShardedStrategy, DistCkptSaveShardedStrategy

    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", values(torch.float32, (16, 4), i)) for i in range(6)}
    distckpt.save(state, tmp_path, sharded_strategy=DistCkptSaveShardedStrategy(thread_count=3))
    assert len(glob.glob(str(tmp_path / "data-*.safetensors"))) == 3
    req = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.zeros(16, 4)) for i in range(6)}
    out = distckpt.load(req, tmp_path, sharded_strategy=DistCkptLoadShardedStrategy(thread_count=4))
    for i in range(6):
        assert torch.equal(out[f"t{i}"], values(torch.float32, (16, 4), i))


# --- strict handling -----------------------------------------------------------------------

def _extra_request():
    req = request()
    req["ghost"] = ShardedTensor.from_rank_offsets("ghost", torch.zeros(2))
    del req["layer"]  # "b" is in the checkpoint but not requested: missing
    return req


def test_strict_assume_ok_fails_on_unexpected_key_with_clear_error(ckpt):
    with pytest.raises(MissingKeyError, match="'ghost' is not in the checkpoint"):
        distckpt.load(_extra_request(), ckpt)


@pytest.mark.parametrize("strict", [StrictHandling.RAISE_UNEXPECTED, "raise_unexpected", "RAISE_ALL"])
def test_strict_raise_modes(ckpt, strict):
    with pytest.raises(MissingKeyError, match="ghost"):
        distckpt.load(_extra_request(), ckpt, strict=strict)


def test_strict_raise_all_reports_missing_keys(ckpt):
    req = request()
    del req["layer"]
    with pytest.raises(MissingKeyError, match="requested by no rank: \\['b'\\]"):
        distckpt.load(req, ckpt, strict=StrictHandling.RAISE_ALL)


def test_strict_return_modes(ckpt):
    state, missing, unexpected = distckpt.load(_extra_request(), ckpt, strict=StrictHandling.RETURN_ALL)
    assert missing == {"b"} and unexpected == {"ghost"}
    assert "ghost" not in state and torch.equal(state["w"], values(torch.float32, (8, 6)))
    state, missing, unexpected = distckpt.load(_extra_request(), ckpt, strict="return_unexpected")
    assert missing == set() and unexpected == {"ghost"}


@pytest.mark.parametrize("strict", [False, "log_unexpected", "log_all", "ignore_all"])
def test_strict_skip_modes_load_the_rest(ckpt, strict, caplog):
    out = distckpt.load(_extra_request(), ckpt, strict=strict)
    assert isinstance(out, dict) and "ghost" not in out and out["step"] == 7
    if strict != "ignore_all":
        assert "ghost" in caplog.text


def test_strict_flag_parsing():
    from distckpt.validation import parse_strict_flag

    assert parse_strict_flag(True) is StrictHandling.ASSUME_OK_UNEXPECTED
    assert parse_strict_flag(False) is StrictHandling.LOG_UNEXPECTED
    assert parse_strict_flag("Return_All") is StrictHandling.RETURN_ALL
    assert len(StrictHandling) == 8
    with pytest.raises(ValueError, match="invalid strict"):
        parse_strict_flag("sometimes")


# --- overwrite and bad input -----------------------------------------------------------------

def test_saving_over_a_checkpoint_needs_overwrite(ckpt):
    with pytest.raises(CheckpointExistsError, match="overwrite=True") as info:
        distckpt.save(model_state(torch.ones(8, 6)), ckpt)
    assert isinstance(info.value, FileExistsError)
    assert torch.equal(distckpt.load(request(), ckpt)["w"], values(torch.float32, (8, 6)))
    old_files = set(os.listdir(ckpt))
    distckpt.save(model_state(torch.ones(8, 6)), ckpt, overwrite=True)
    assert torch.equal(distckpt.load(request(), ckpt)["w"], torch.ones(8, 6))
    assert not (old_files - {"metadata.json"}) & set(os.listdir(ckpt))  # old files removed


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint here") as info:
        distckpt.load(request(), tmp_path / "nope")
    assert isinstance(info.value, FileNotFoundError)


def test_missing_metadata_json_is_incomplete(ckpt):
    os.remove(ckpt / "metadata.json")
    with pytest.raises(IncompleteCheckpointError, match="metadata.json .* is missing"):
        distckpt.load(request(), ckpt)
    distckpt.save(model_state(), ckpt)  # a retried save into the same directory succeeds
    assert distckpt.load(request(), ckpt)["step"] == 7


def test_wrong_dtype_is_a_clear_error(ckpt):
    with pytest.raises(MismatchError, match="'w' was saved as float32 but is requested as bfloat16"):
        distckpt.load(request(dtype=torch.bfloat16), ckpt)


def test_wrong_shape_is_a_clear_error(ckpt):
    with pytest.raises(MismatchError, match=r"'w' was saved with global shape \(8, 6\).*\(9, 6\)"):
        distckpt.load(request(w_shape=(9, 6)), ckpt)


def test_allow_shape_mismatch_loads_the_overlap(ckpt):
    data = torch.full((10, 6), -1.0)
    req = {"w": ShardedTensor.from_rank_offsets("w", data, allow_shape_mismatch=True)}
    distckpt.load(req, ckpt)
    assert torch.equal(data[:8], values(torch.float32, (8, 6)))
    assert torch.equal(data[8:], torch.full((2, 6), -1.0))


@pytest.mark.parametrize("cut", ["object", "tensor"])
def test_truncated_data_file(ckpt, cut):
    (data_file,) = glob.glob(str(ckpt / "data-*.safetensors"))
    start, header = _header(data_file)
    keep = start + header["w@0,0"]["data_offsets"][0] + 8 if cut == "tensor" else os.path.getsize(data_file) - 40
    with open(data_file, "r+b") as f:
        f.truncate(keep)
    what = "tensor 'w'" if cut == "tensor" else "object 'rng/shard_0_1'"
    with pytest.raises(distckpt.TruncatedFileError, match=f"data-.*safetensors.*{what}"):
        distckpt.load(request(), ckpt)
    assert cli_main(["verify", str(ckpt)]) == 1


def test_flipped_byte_names_file_and_key(ckpt):
    (data_file,) = glob.glob(str(ckpt / "data-*.safetensors"))
    _, header = _header(data_file)
    begin = header["w@0,0"]["data_offsets"][0] + _header(data_file)[0]
    _flip(data_file, begin + 5)
    with pytest.raises(ChecksumError, match=r"data-.*\.safetensors: checksum mismatch in tensor 'w'"):
        distckpt.load(request(), ckpt)
    assert cli_main(["verify", str(ckpt)]) == 1


def test_flipped_byte_in_index_and_metadata_and_common(ckpt, tmp_path):
    meta = json.loads((ckpt / "metadata.json").read_text())
    for name, error in [(meta["index"]["file"], ChecksumError), (meta["common"]["file"], ChecksumError)]:
        copy = tmp_path / f"copy-{name}"
        _copytree(ckpt, copy)
        _flip(copy / name, 20)
        with pytest.raises(error, match=name):
            distckpt.load(request(), copy)
    copy = tmp_path / "copy-meta"
    _copytree(ckpt, copy)
    text = (copy / "metadata.json").read_text().replace('"world_size": 1', '"world_size": 2')
    (copy / "metadata.json").write_text(text)
    with pytest.raises(CorruptCheckpointError, match="metadata.json: checksum mismatch"):
        distckpt.load(request(), copy)


def test_missing_data_file(ckpt):
    for f in glob.glob(str(ckpt / "data-*.safetensors")):
        os.remove(f)
    with pytest.raises(StorageError, match="data file is missing"):
        distckpt.load(request(), ckpt)
    with pytest.raises(StorageError, match="data file is missing .*tensor 'w'"):
        distckpt.load({"w": request()["w"]}, ckpt)


def _rewrite_index(ckpt, mutate):
    """Change the index and re-seal metadata.json, as a forger (or a buggy writer) could."""
    from distckpt import checksum
    from distckpt.format.metadata import CheckpointMetadata, FileRef

    meta = CheckpointMetadata.from_json((ckpt / "metadata.json").read_bytes(), "m")
    index = json.loads((ckpt / meta.index.file).read_text())
    mutate(index)
    raw = json.dumps(index).encode()
    (ckpt / meta.index.file).write_bytes(raw)
    meta.index = FileRef(meta.index.file, len(raw), checksum.crc32c(raw))
    (ckpt / "metadata.json").write_bytes(meta.to_json())


def _list_chunks(index):
    """Replace every grid of an index document by its chunks listed one by one (also valid)."""
    from distckpt.format.index import CheckpointIndex

    parsed = CheckpointIndex.from_json(json.dumps(index).encode(), "index")
    for key, t in index["tensors"].items():
        if t.pop("grid", None) is not None:
            t["chunks"] = [
                {"offset": list(c.offset), "shape": list(c.shape), "file": index["files"].index(c.file),
                 "data_offset": c.data_offset, "nbytes": c.nbytes, "crc32c": list(c.crc32c)}
                for c in parsed.tensors[key].chunks
            ]


def test_index_with_a_hole_is_refused(tmp_path):
    state = {"w": [ShardedTensor.from_global_offset("w", torch.ones(2, 4), (4, 4), (0, 0)),
                   ShardedTensor.from_global_offset("w", torch.ones(2, 4), (4, 4), (2, 0))]}
    distckpt.save(state, tmp_path)
    _rewrite_index(tmp_path, lambda index: (_list_chunks(index), index["tensors"]["w"]["chunks"].pop()))
    with pytest.raises(CorruptCheckpointError, match=r"'w': the checkpoint has no data for 8 elements"):
        distckpt.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4, 4))}, tmp_path)


def test_index_with_overlapping_chunks_or_escaping_paths_is_refused(tmp_path):
    state = {"w": [ShardedTensor.from_global_offset("w", torch.ones(2, 4), (4, 4), (0, 0)),
                   ShardedTensor.from_global_offset("w", torch.ones(2, 4), (4, 4), (2, 0))]}
    distckpt.save(state, tmp_path)

    def overlap(index):
        _list_chunks(index)
        index["tensors"]["w"]["chunks"][1]["offset"] = [1, 0]

    _rewrite_index(tmp_path, overlap)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        distckpt.load_plain_tensors(tmp_path)

    def escape(index):
        index["files"][0] = "../../etc/passwd"

    _rewrite_index(tmp_path, escape)
    with pytest.raises(CorruptCheckpointError, match="plain file names"):
        distckpt.load_plain_tensors(tmp_path)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /tmp/distckpt-pwned",))


def test_hostile_pickle_in_common_state_is_refused(tmp_path):
    state = model_state()
    state["evil"] = Evil()
    distckpt.save(state, tmp_path)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        distckpt.load(request(), tmp_path)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle=True"):
        distckpt.load_common_state_dict(tmp_path)
    assert not os.path.exists("/tmp/distckpt-pwned")


def test_hostile_pickle_in_sharded_object_is_refused(tmp_path):
    state = model_state()
    state["rng"] = ShardedObject("rng", Evil(), (1,), (0,))
    distckpt.save(state, tmp_path)
    with pytest.raises(UnsafeCheckpointError, match="allow_pickle"):
        distckpt.load(request(), tmp_path)


def test_opt_in_allows_trusted_python_objects(tmp_path):
    import argparse

    state = model_state()
    state["args"] = argparse.Namespace(lr=0.5)
    distckpt.save(state, tmp_path)
    with pytest.raises(UnsafeCheckpointError):
        distckpt.load(request(), tmp_path)
    assert distckpt.load(request(), tmp_path, allow_pickle=True)["args"].lr == 0.5


def test_invalid_sharding_is_rejected_before_writing(tmp_path):
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, 0, 2))}  # half missing
    with pytest.raises(ShardingValidationError, match=r"'w'.*\[2:4, 0:4\] is missing"):
        distckpt.save(state, tmp_path)
    assert not (tmp_path / "metadata.json").exists()
    assert os.listdir(tmp_path) == []


def test_sharded_object_grid_mismatch_is_named(ckpt):
    req = request()
    req["rng"] = ShardedObject("rng", None, (2,), (1,))
    with pytest.raises(MismatchError, match="'rng' was saved as a grid of shape \\(1,\\)"):
        distckpt.load(req, ckpt, validate_access_integrity=False)


def test_mapping_validation_errors():
    with pytest.raises(CheckpointingException, match="invalid rank offset"):
        ShardedTensor.from_rank_offsets("x", torch.zeros(2), (0, 2, 2))
    with pytest.raises(CheckpointingException, match="from_rank_offsets_flat"):
        ShardedTensor.from_rank_offsets("x", torch.zeros(2), flattened_range=slice(0, 1))
    with pytest.raises(CheckpointingException, match="holds 3 elements but data has 2"):
        ShardedTensor.from_rank_offsets_flat("x", torch.zeros(2), (2, 2), flattened_range=slice(0, 3))
    with pytest.raises(CheckpointingException, match="outside the global shape"):
        ShardedTensor("x", torch.zeros(2), torch.float32, (2,), (3,), (2,), None)


def test_from_rank_offsets_semantics():
    st = ShardedTensor.from_rank_offsets("x", torch.zeros(3, 4), (0, 1, 2), (2, 3, 5), prepend_axis_num=1,
                                         replica_id=(0, 1))
    # axis 0 is the prepended axis (length 1 locally); axis 2 is data axis 1 (length 4)
    assert st.global_shape == (2, 3, 20) and st.global_offset == (1, 0, 12)
    assert st.axis_fragmentations == (2, 1, 5) and st.local_shape == (3, 4)
    assert st.local_chunk_offset_in_global() == (1, 0, 3)
    assert st.global_slice() == (1, slice(0, 3), slice(12, 16))
    flat = ShardedTensor.from_rank_offsets_flat("y", torch.zeros(5), (3, 4), (0, 1, 2), flattened_range=slice(2, 7))
    assert flat.global_shape == (6, 4) and flat.flattened_range == slice(2, 7) and flat.local_shape == (3, 4)
    obj = ShardedObject("rng", 1, (2, 4), (1, 3))
    assert obj.unique_key == "rng/shard_1.3_2.4"
    assert ShardedObject.empty_from_unique_key("a/b/shard_1.3_2.4").key == "a/b"


def test_errors_are_exceptions_with_builtin_parents():
    assert issubclass(CheckpointingException, Exception) and not issubclass(CheckpointingException, KeyboardInterrupt)
    assert issubclass(CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(CheckpointExistsError, FileExistsError)
    assert issubclass(MismatchError, ValueError)


# --- CLI --------------------------------------------------------------------------------------

def test_cli_inspect(ckpt, capsys):
    assert cli_main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "w  " in out and "float32" in out and "8x6" in out and "rng/shard_0_1" in out
    assert "args, step" in out
    assert cli_main(["inspect", "--json", str(ckpt)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {t["key"]: (t["bytes"], t["chunks"]) for t in info["tensors"]} == {"b": (24, 1), "w": (192, 1)}
    assert info["totals"]["tensor_bytes"] == 216


def test_cli_verify_ok_and_missing(ckpt, tmp_path, capsys):
    assert cli_main(["verify", str(ckpt)]) == 0
    assert "OK" in capsys.readouterr().out
    assert cli_main(["verify", str(tmp_path / "none")]) == 1


def test_cli_entry_point_runs(ckpt):
    result = subprocess.run([sys.executable, "-m", "distckpt.cli", "inspect", str(ckpt)], capture_output=True, text=True)
    assert result.returncode == 0 and "total" in result.stdout


# --- helpers ------------------------------------------------------------------------------------

def _header(path):
    import struct

    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _copytree(src, dst):
    import shutil

    shutil.copytree(src, dst)


def test_interrupted_overwrite_keeps_the_previous_checkpoint(ckpt, monkeypatch):
    from distckpt.storage.local import LocalStorage

    original = LocalStorage.write_atomic

    def crash_before_commit(self, name, data):
        if name == "metadata.json":
            raise OSError(5, "simulated crash before the commit marker")
        return original(self, name, data)

    before = set(os.listdir(ckpt))
    monkeypatch.setattr(LocalStorage, "write_atomic", crash_before_commit)
    with pytest.raises(StorageError, match="simulated crash"):
        distckpt.save(model_state(torch.ones(8, 6)), ckpt, overwrite=True)
    monkeypatch.setattr(LocalStorage, "write_atomic", original)
    # The failed save removed what it wrote; the marker still names the old checkpoint.
    assert set(os.listdir(ckpt)) == before
    assert torch.equal(distckpt.load(request(), ckpt)["w"], values(torch.float32, (8, 6)))
    assert cli_main(["verify", str(ckpt)]) == 0
    distckpt.save(model_state(torch.ones(8, 6)), ckpt, overwrite=True)  # the retry succeeds
    assert torch.equal(distckpt.load(request(), ckpt)["w"], torch.ones(8, 6))


def test_nothing_touches_cuda_on_the_cpu_path(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda used on a CPU-only path")

    for name in ["is_available", "current_device", "synchronize", "device_count", "set_device"]:
        monkeypatch.setattr(torch.cuda, name, forbidden)
    distckpt.save(model_state(), tmp_path)
    assert distckpt.load(request(), tmp_path)["step"] == 7


def test_overwrite_removes_every_file_of_the_replaced_checkpoint(tmp_path):
    from distckpt.strategies import DistCkptSaveShardedStrategy

    many_files = DistCkptSaveShardedStrategy(thread_count=3)
    state = {k: ShardedTensor.from_rank_offsets(k, torch.full((4,), float(i))) for i, k in enumerate("abc")}
    state["empty"] = ShardedTensor.from_rank_offsets("empty", torch.zeros(0))
    distckpt.save(state, tmp_path, sharded_strategy=many_files)
    # No data file without an index entry, even with more threads than non-empty chunks.
    reader = distckpt.engine.checkpoint.CheckpointReader(tmp_path)
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("data-")) == reader.index.files
    distckpt.remove_sharded_tensors(tmp_path, "a")
    distckpt.save({"z": ShardedTensor.from_rank_offsets("z", torch.ones(2))}, tmp_path, overwrite=True)
    reader = distckpt.engine.checkpoint.CheckpointReader(tmp_path)
    expected = set(reader.index.files) | {reader.metadata.index.file, reader.metadata.common.file, "metadata.json"}
    assert set(os.listdir(tmp_path)) == expected


def test_unpicklable_common_state_fails_before_writing_and_names_the_key(ckpt):
    import threading

    before = set(os.listdir(ckpt))
    state = model_state()
    state["args"] = {"ok": 1, "lock": threading.Lock()}
    with pytest.raises(CheckpointingException, match=r"\['args'\]\['lock'\].*LocalNonPersistentObject"):
        distckpt.save(state, ckpt, overwrite=True)
    assert set(os.listdir(ckpt)) == before
    assert distckpt.load(request(), ckpt)["step"] == 7


def test_load_into_parameters_and_conjugate_views(tmp_path):
    distckpt.save({"w": [ShardedTensor.from_global_offset("w", torch.ones(2, 6), (4, 6), (0, 0)),
                         ShardedTensor.from_global_offset("w", torch.full((2, 6), 2.0), (4, 6), (2, 0))],
                   "c": ShardedTensor.from_rank_offsets("c", torch.tensor([1 + 2j, 3 - 1j]).conj())}, tmp_path)
    param = torch.nn.Parameter(torch.zeros(4, 3))
    out = distckpt.load({"w": ShardedTensor.from_rank_offsets("w", param, (1, 0, 2)),
                         "c": ShardedTensor.from_rank_offsets("c", torch.zeros(2, dtype=torch.complex64))},
                        tmp_path, validate_access_integrity=False)
    assert out["w"] is param and torch.equal(param.detach(), torch.tensor([[1.0] * 3] * 2 + [[2.0] * 3] * 2))
    assert torch.equal(out["c"], torch.tensor([1 - 2j, 3 + 1j]))


def test_sharded_object_grid_mismatch_is_not_a_key_mismatch(tmp_path):
    distckpt.save({"rng": ShardedObject("rng", 1, (1,), (0,))}, tmp_path)
    req = {"rng": ShardedObject("rng", None, (2,), (0,))}
    with pytest.raises(MismatchError, match="grid of shape"):
        distckpt.load(req, tmp_path, strict="return_all", validate_access_integrity=False)


def test_dimension_mismatch_is_named_even_with_allow_shape_mismatch(ckpt):
    req = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(48), allow_shape_mismatch=True)}
    with pytest.raises(MismatchError, match="number of dimensions must match"):
        distckpt.load(req, ckpt)
