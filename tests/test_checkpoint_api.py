"""distckpt.checkpoint (OLMo-core's API) with real FSDP2 / DDP groups over gloo, and in one
process without torch.distributed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from distckpt import checkpoint as ckpt
from distckpt.errors import CheckpointingException, MismatchError, MissingKeyError

VOCAB, HIDDEN, FF = 13, 10, 22  # uneven over 4 ranks: FSDP2 leaves trailing shards short or empty


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.up = torch.nn.Linear(HIDDEN, FF)
        self.down = torch.nn.Linear(FF, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(torch.nn.Module):
    """A small transformer-like model (embedding, residual MLP blocks, tied-free head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (4, 6), generator=g)
    return ids[:, :-1], ids[:, 1:]


def build(wrap: str, seed: int, optim_kind: str = "adamw") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model: torch.nn.Module = TinyLM()
    if wrap == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    if optim_kind == "adamw":
        optim: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=0.01 + seed * 1e-3)
    else:
        optim = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, optim


def train_step(model: torch.nn.Module, optim: torch.optim.Optimizer, step: int) -> None:
    inputs, targets = batch(step)  # the same batch on every rank: gradients are exact averages
    logits = model(inputs)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def snapshot(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict:
    """Full (unsharded) parameters, optimizer state, hyperparameters and the model's output."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    with torch.no_grad():
        out = full(model(batch(99)[0]))
    params = {k: full(v) for k, v in get_model_state_dict(model).items()}
    osd = get_optimizer_state_dict(model, optim)
    state = {f"{p}.{n}": full(v) for p, s in osd["state"].items() for n, v in s.items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
    return {"out": out, "params": params, "state": state, "groups": groups}


def assert_same(a: dict, b: dict, what: str = "") -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        if isinstance(a[key], dict):
            assert_same(a[key], b[key], f"{what}{key}.")
        elif isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{what}{key} differs"
        else:
            assert a[key] == b[key], f"{what}{key}: {a[key]!r} != {b[key]!r}"


def _save_fsdp(path: str, optim_kind: str, flatten: bool, use_async: bool) -> dict | None:
    model, optim = build("fsdp", seed=0, optim_kind=optim_kind)
    for step in range(2):
        train_step(model, optim, step)
    if use_async:
        future = ckpt.async_save_model_and_optim_state(path, model, optim, flatten_optimizer_state=flatten)
        train_step(model, optim, 50)  # training goes on while the save is written
        future.result()
        model, optim = build("fsdp", seed=0, optim_kind=optim_kind)
        ckpt.load_model_and_optim_state(path, model, optim, flatten_optimizer_state=flatten)
    else:
        ckpt.save_model_and_optim_state(path, model, optim, flatten_optimizer_state=flatten)
    before = snapshot(model, optim)
    train_step(model, optim, 2)
    after = snapshot(model, optim)
    return {"before": before, "after": after} if tdist.get_rank() == 0 else None


def _resume(path: str, wrap: str, optim_kind: str, flatten: bool) -> dict | None:
    model, optim = build(wrap, seed=7, optim_kind=optim_kind)  # other init: loading must matter
    ckpt.load_model_and_optim_state(path, model, optim, flatten_optimizer_state=flatten)
    before = snapshot(model, optim)
    train_step(model, optim, 2)
    after = snapshot(model, optim)
    rank = tdist.get_rank() if tdist.is_initialized() else 0
    return {"before": before, "after": after} if rank == 0 else None


@pytest.mark.parametrize(
    "optim_kind,flatten,use_async",
    [("adamw", False, False), ("sgd", True, False), ("adamw", False, True)],
    ids=["adamw", "sgd-momentum-flattened", "adamw-async"],
)
def test_fsdp2_checkpoint_resumes_in_other_topologies(dist, tmp_path, optim_kind, flatten, use_async):
    path = str(tmp_path / "ckpt")
    saved = dist.run(4, _save_fsdp, path, optim_kind, flatten, use_async, timeout=240)[0]
    for wrap in ("fsdp", "ddp"):
        resumed = dist.run(2, _resume, path, wrap, optim_kind, flatten, timeout=240)[0]
        assert_same(saved["before"], resumed["before"], f"{wrap} load: ")
        assert_same(saved["after"]["params"], resumed["after"]["params"], f"{wrap} step: ")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: kernels then reduce in the same order
    try:
        single = _resume(path, "none", optim_kind, flatten)  # this process: no torch.distributed
    finally:
        torch.set_num_threads(threads)
    assert single is not None
    assert_same(saved["before"], single["before"], "single-process load: ")
    assert_same(saved["after"]["params"], single["after"]["params"], "single-process step: ")


def _save_nested(path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rank, world = tdist.get_rank(), tdist.get_world_size()
    mesh2d = init_device_mesh("cpu", (2, world // 2))
    full_w = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    state = {
        "w": distribute_tensor(full_w, mesh2d, [Shard(0), Shard(1)]),
        "rep": distribute_tensor(full_w * 2, mesh2d, [Replicate(), Shard(0)]),
        "plain": torch.tensor([1.5, 2.5]),
        "meta": {"step": 12, "names": ["a", "b"], "nested": {"lr": 0.5}},
    }
    # our boxes agree with torch's own computation, and Partial placements are refused
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for tensor in (state["w"], state["rep"]):
        offset, local_shape, _ = ckpt.dtensor_box(tensor)
        assert (local_shape, offset) == tuple(map(tuple, compute_local_shape_and_global_offset(
            tensor.shape, tensor.device_mesh, tensor.placements)))
    partial = state["w"].redistribute(placements=[Shard(0), Shard(1)])
    partial = torch.distributed.tensor.DTensor.from_local(partial.to_local(), mesh2d, [Partial(), Shard(1)])
    with pytest.raises(CheckpointingException, match="Partial"):
        ckpt.dtensor_box(partial)
    ckpt.save_state_dict(path, state)
    del rank


def _load_nested(path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world = tdist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state = {
        "w": distribute_tensor(torch.zeros(7, 5), mesh, [Shard(1)]),
        "rep": torch.zeros(7, 5),
        "plain": torch.zeros(2),
        "meta": {"step": 0, "names": [None, None], "nested": {"lr": 0.0}},
    }
    ckpt.load_state_dict(path, state)
    return {"w": state["w"].full_tensor(), "rep": state["rep"], "plain": state["plain"], "meta": state["meta"]}


def test_state_dict_of_dtensors_on_a_2d_mesh_loads_into_another_mesh(dist, tmp_path):
    path = str(tmp_path / "sd")
    dist.run(4, _save_nested, path)
    results = dist.run(3, _load_nested, path)
    full_w = torch.arange(35, dtype=torch.float32).reshape(7, 5)
    for r in results:
        assert torch.equal(r["w"], full_w)
        assert torch.equal(r["rep"], full_w * 2)
        assert torch.equal(r["plain"], torch.tensor([1.5, 2.5]))
        assert r["meta"] == {"step": 12, "names": ["a", "b"], "nested": {"lr": 0.5}}
    # and in one process, through load_keys and the metadata
    info = ckpt.get_checkpoint_metadata(path)
    assert info.state_dict_metadata["w"].shape == (7, 5)
    assert info.state_dict_metadata["w"].dtype == torch.float32
    w, meta = ckpt.load_keys(path, ["w", "meta"])
    assert torch.equal(w, full_w)
    assert meta == {"step": 12, "names": ["a", "b"], "nested": {"lr": 0.5}}


def _async_save_then_mutate(path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    weight = distribute_tensor(torch.arange(64.0).reshape(16, 4), mesh, [Shard(0)])
    state = {"w": weight, "step": torch.tensor(3), "extra": {"note": "x"}}
    future = ckpt.async_save_state_dict(path, state, thread_count=3)
    weight.to_local().fill_(-1.0)  # training goes on: must not reach the checkpoint
    state["step"].add_(1)
    future.result(timeout=60)
    loaded = {"w": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]), "step": torch.tensor(0), "extra": {"note": ""}}
    ckpt.load_state_dict(path, loaded)
    assert torch.equal(loaded["w"].full_tensor(), torch.arange(64.0).reshape(16, 4))
    assert loaded["step"].item() == 3 and loaded["extra"] == {"note": "x"}
    with pytest.raises(FileExistsError, match="save_overwrite"):  # raised before returning
        ckpt.async_save_state_dict(path, state)


def test_async_save_is_isolated_from_later_mutation(dist, tmp_path):
    path = tmp_path / "async"
    dist.run(2, _async_save_then_mutate, str(path), timeout=120)
    assert len([f for f in path.iterdir() if f.name.startswith("data-")]) >= 2


def _save_disagreeing(path: str) -> None:
    ckpt.save_state_dict(path, {"seed": tdist.get_rank()})


def test_values_that_differ_between_ranks_are_refused(dist, tmp_path):
    path = tmp_path / "bad"
    failure = None
    try:
        dist.run(2, _save_disagreeing, str(path))
    except AssertionError as exc:
        failure = exc
    assert failure is not None
    text = str(failure)
    assert "ShardingValidationError" in text and "'seed'" in text and "ranks 0 and 1" in text
    assert not (path / "metadata.json").exists()


def test_save_overwrite_and_missing_keys(tmp_path):
    path = tmp_path / "c"
    ckpt.save_state_dict(path, {"a": torch.ones(3), "b": {"c": 4}})
    with pytest.raises(FileExistsError, match="save_overwrite=True"):
        ckpt.save_state_dict(path, {"a": torch.zeros(3)})
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match=str(tmp_path / "other")):
        ckpt.save_state_dict(tmp_path / "other", {"a": torch.zeros(3)})
    ckpt.save_state_dict(path, {"a": torch.full((3,), 2.0), "b": {"c": 5}}, save_overwrite=True)
    state = {"a": torch.zeros(3), "b": {"c": 0}}
    ckpt.load_state_dict(path, state)
    assert torch.equal(state["a"], torch.full((3,), 2.0)) and state["b"] == {"c": 5}
    with pytest.raises(MissingKeyError, match="'x'"):
        ckpt.load_state_dict(path, {"a": torch.zeros(3), "x": torch.zeros(1)})
    with pytest.raises(Exception, match="shape"):
        ckpt.load_state_dict(path, {"a": torch.zeros(4)})


def test_key_mapping_and_non_strict_load(tmp_path):
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(src.parameters())
    src(torch.randn(2, 3)).sum().backward()
    optim.step()
    ckpt.save_model_and_optim_state(tmp_path / "c", src, optim)

    class Renamed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = torch.nn.Linear(3, 4)
            self.second = torch.nn.Linear(4, 2)
            self.extra = torch.nn.Linear(2, 2)

    dst = Renamed()
    dst_optim = torch.optim.AdamW(dst.parameters())
    extra_before = dst.extra.weight.detach().clone()
    mapping = {"first.weight": "0.weight", "first.bias": "0.bias", "second.weight": "1.weight", "second.bias": "1.bias"}
    with pytest.raises(MissingKeyError, match="extra.weight"):
        ckpt.load_model_and_optim_state(tmp_path / "c", dst, dst_optim, key_mapping=mapping)
    ckpt.load_model_and_optim_state(tmp_path / "c", dst, dst_optim, key_mapping=mapping, strict=False)
    assert torch.equal(dst.first.weight, src[0].weight) and torch.equal(dst.second.bias, src[1].bias)
    assert torch.equal(dst.extra.weight, extra_before)
    saved_state = optim.state_dict()["state"]
    loaded_state = dst_optim.state_dict()["state"]
    assert torch.equal(loaded_state[0]["exp_avg"], saved_state[0]["exp_avg"])
    assert torch.equal(loaded_state[3]["exp_avg_sq"], saved_state[3]["exp_avg_sq"])


def _unshard_source(path: str) -> None:
    model, optim = build("fsdp", seed=3)
    train_step(model, optim, 0)
    ckpt.save_model_and_optim_state(path, model, optim)


@pytest.fixture(scope="module")
def fsdp_checkpoint(dist, tmp_path_factory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("unshard") / "ckpt")
    dist.run(4, _unshard_source, path, timeout=240)
    model, optim = build("none", seed=9)
    ckpt.load_model_and_optim_state(path, model, optim)
    return path, {"model": model.state_dict(), "optim": optim}


@pytest.mark.parametrize("strategy", ["one_file", "one_file_per_tensor", "chunks"])
@pytest.mark.parametrize("use_safetensors", [False, True], ids=["torch", "safetensors"])
def test_unshard(fsdp_checkpoint, tmp_path, strategy, use_safetensors, capsys):
    path, expected = fsdp_checkpoint
    chosen = {
        "one_file": ckpt.UnshardStrategy.one_file(),
        "one_file_per_tensor": ckpt.UnshardStrategy.one_file_per_tensor(),
        "chunks": ckpt.UnshardStrategy.chunks(500),
    }[strategy]
    model_out, optim_out = ckpt.unshard_checkpoint(
        path, tmp_path / "out", use_safetensors=use_safetensors, unshard_strategy=chosen
    )
    assert "unsharding [" in capsys.readouterr().err  # the progress bar
    assert (optim_out is None) == use_safetensors
    model_state = _read_outputs(Path(model_out), use_safetensors, strategy)
    assert model_state.keys() == expected["model"].keys()
    for key, value in expected["model"].items():
        assert torch.equal(model_state[key], value), key
    if strategy == "chunks":
        files = sorted(Path(model_out).iterdir())
        assert len(files) > 3
        for f in files:  # tensors grouped up to 500 bytes; a larger tensor alone in its file
            group = _read_outputs(f.parent, use_safetensors, strategy, keep=f.name)
            nbytes = sum(t.numel() * t.element_size() for t in group.values())
            assert nbytes <= 500 or len(group) == 1, (f.name, nbytes)
    if optim_out is not None:
        saved = expected["optim"].state_dict()
        names = list(expected["model"].keys())
        if strategy == "one_file":
            optim_state = torch.load(optim_out, weights_only=True)
            for i, name in enumerate(names):
                for k, v in saved["state"][i].items():
                    assert torch.equal(optim_state["state"][name][k], v)
            assert optim_state["param_groups"][0]["lr"] == saved["param_groups"][0]["lr"]
        else:
            tensors = _read_outputs(Path(optim_out), False, strategy, skip={"objects.pt"})
            for i, name in enumerate(names):
                for k, v in saved["state"][i].items():
                    assert torch.equal(tensors[f"state.{name}.{k}"], v)
            objects = torch.load(Path(optim_out) / "objects.pt", weights_only=True)
            assert objects["param_groups"][0]["params"] == names
    with pytest.raises(FileExistsError, match="save_overwrite"):
        ckpt.unshard_checkpoint(path, tmp_path / "out", use_safetensors=use_safetensors, quiet=True)


def _read_outputs(
    out: Path, use_safetensors: bool, strategy: str, skip: set[str] = frozenset(), keep: str | None = None
) -> dict:
    if strategy == "one_file":
        if use_safetensors:
            from safetensors.torch import load_file

            return load_file(out)
        return torch.load(out, weights_only=True)
    state = {}
    for f in sorted(out.iterdir()):
        if f.name in skip or keep not in (None, f.name):
            continue
        if use_safetensors:
            from safetensors.torch import load_file

            state.update(load_file(f))
        elif strategy == "chunks":
            state.update(torch.load(f, weights_only=True))
        else:
            state[f.name[: -len(".pt")]] = torch.load(f, weights_only=True)
    return state


def test_cli_unshard(fsdp_checkpoint, tmp_path, capsys):
    from distckpt.cli import main

    path, expected = fsdp_checkpoint
    assert main(["unshard", path, str(tmp_path / "out"), "--safetensors", "--strategy", "chunks",
                 "--chunk-size", "1KiB"]) == 0
    captured = capsys.readouterr()
    assert "unsharding [" in captured.err and f"model: {tmp_path / 'out' / 'model'}" in captured.out
    state = _read_outputs(tmp_path / "out" / "model", True, "chunks")
    assert state.keys() == expected["model"].keys()
    assert all(torch.equal(state[k], v) for k, v in expected["model"].items())
    assert main(["unshard", path, str(tmp_path / "out"), "--quiet"]) == 1
    assert "--overwrite" in capsys.readouterr().err
    assert main(["unshard", path, str(tmp_path / "out"), "--quiet", "--overwrite"]) == 0
    optim_state = torch.load(tmp_path / "out" / "optim.pt", weights_only=True)
    assert set(optim_state["state"]) == set(expected["model"])
    with pytest.raises(SystemExit):
        main(["unshard", path, str(tmp_path / "o2"), "--strategy", "chunks"])  # no --chunk-size
    with pytest.raises(SystemExit):
        main(["unshard", path, str(tmp_path / "o2"), "--strategy", "chunks", "--chunk-size", "lots"])


def test_unshard_refuses_optimizer_in_safetensors(fsdp_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="use_safetensors"):
        ckpt.unshard_checkpoint(fsdp_checkpoint[0], tmp_path / "o", optim=True, use_safetensors=True)


_EXPORT_SCRIPT = """
import resource, sys
from distckpt.checkpoint import unshard_checkpoint
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
unshard_checkpoint(sys.argv[1], sys.argv[2], use_safetensors=True, quiet=True)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_unshard_memory_is_bounded_by_the_largest_tensor(tmp_path):
    """Streaming safetensors export of a 64 MiB checkpoint of 8 MiB tensors, in a fresh process."""
    state = {f"t{i}": torch.full((2 * 1024 * 1024,), float(i)) for i in range(8)}
    ckpt.save_state_dict(tmp_path / "big", {"model": state})
    del state
    done = subprocess.run(
        [sys.executable, "-c", _EXPORT_SCRIPT, str(tmp_path / "big"), str(tmp_path / "export")],
        capture_output=True, text=True, check=True,
    )
    grown_mib = float(done.stdout.split()[-1])
    assert grown_mib < 40, f"peak RSS grew by {grown_mib:.0f} MiB for a 64 MiB export"
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == [f"t{i}" for i in range(8)]
        assert torch.equal(f.get_tensor("t5"), torch.full((2 * 1024 * 1024,), 5.0))


def test_options_are_validated():
    with pytest.raises(ValueError, match="thread_count"):
        ckpt.save_state_dict("unused", {}, thread_count=0)
    with pytest.raises(ValueError, match="chunk_size_bytes"):
        ckpt.UnshardStrategy("chunks")


def test_keys_that_flatten_to_the_same_name_are_refused(tmp_path):
    with pytest.raises(CheckpointingException, match="'a.b'"):
        ckpt.save_state_dict(tmp_path / "x", {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})
    assert not (tmp_path / "x" / "metadata.json").exists()


# ---------------------------------------------------------------------------------------------
# Regressions from review


def _save_sets_and_bad_key(path: str, bad_rank: int) -> str:
    state = {"tags": {"alpha", "beta", "gamma", "delta"}, "w": torch.ones(2)}
    if tdist.get_rank() == bad_rank:
        state["extra"] = {1: torch.ones(1)}  # a non-string key on one rank only
    try:
        ckpt.save_state_dict(path, state)
    except CheckpointingException as exc:
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_equal_sets_are_replicas_and_one_bad_rank_fails_every_rank(dist, tmp_path):
    assert dist.run(2, _save_sets_and_bad_key, str(tmp_path / "ok"), -1) == ["saved", "saved"]
    outcomes = dist.run(2, _save_sets_and_bad_key, str(tmp_path / "bad"), 1)
    assert all("keys must be strings" in o for o in outcomes), outcomes


def test_lists_of_values_load_whole_and_kind_mismatch_is_named(tmp_path):
    ckpt.save_state_dict(tmp_path / "c", {"hist": [1, 2, 3], "w": torch.ones(2), "n": 5})
    state = {"hist": [0], "w": torch.zeros(2)}
    ckpt.load_state_dict(tmp_path / "c", state)
    assert state["hist"] == [1, 2, 3]
    with pytest.raises(MismatchError, match="'n' was saved as a Python value"):
        ckpt.load_state_dict(tmp_path / "c", {"n": torch.zeros(1)})
    with pytest.raises(MismatchError, match="'w' was saved as a tensor"):
        ckpt.load_state_dict(tmp_path / "c", {"w": 3})


def test_unshard_overwrite_name_collisions_and_megatron_checkpoints(tmp_path):
    import argparse

    import distckpt

    ckpt.save_state_dict(tmp_path / "six", {"model": {f"w{i}": torch.full((64,), float(i)) for i in range(6)}})
    ckpt.save_state_dict(tmp_path / "two", {"model": {f"w{i}": torch.full((64,), 100.0 + i) for i in range(2)}})
    out = tmp_path / "out"
    ckpt.unshard_checkpoint(tmp_path / "six", out, unshard_strategy=ckpt.UnshardStrategy.chunks(300), quiet=True)
    ckpt.unshard_checkpoint(tmp_path / "two", out, unshard_strategy=ckpt.UnshardStrategy.chunks(300),
                            quiet=True, save_overwrite=True)
    merged = _read_outputs(out / "model", False, "chunks")
    assert sorted(merged) == ["w0", "w1"] and merged["w1"][0].item() == 101.0  # nothing left of "six"

    ckpt.save_state_dict(tmp_path / "names", {"model": {"a/b": torch.ones(1), "a_b": torch.zeros(1)}})
    model_dir, _ = ckpt.unshard_checkpoint(tmp_path / "names", tmp_path / "o2", quiet=True,
                                           unshard_strategy=ckpt.UnshardStrategy.one_file_per_tensor())
    assert sorted(f.name for f in model_dir.iterdir()) == ["a%2Fb.pt", "a_b.pt"]

    megatron = {"args": argparse.Namespace(lr=0.1),
                "w": distckpt.ShardedTensor.from_rank_offsets("w", torch.arange(4.0))}
    distckpt.save(megatron, tmp_path / "mcore")
    model_file, optim = ckpt.unshard_checkpoint(tmp_path / "mcore", tmp_path / "o3", quiet=True)
    assert optim is None and torch.equal(torch.load(model_file)["w"], torch.arange(4.0))


def test_load_keys_prefix_of_flattened_optimizer_state(tmp_path):
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    ckpt.save_model_and_optim_state(tmp_path / "c", model, optim, flatten_optimizer_state=True)
    (state,) = ckpt.load_keys(tmp_path / "c", ["optim.state.weight"])
    assert set(state) == {"exp_avg", "exp_avg_sq", "step"}
    assert torch.equal(state["exp_avg"], optim.state_dict()["state"][0]["exp_avg"])
