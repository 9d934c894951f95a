"""Format v1: documents match their JSON Schemas, and the readers of metadata.json and the index
reject damaged or forged input with the library's own errors only (no crash, no huge allocation)."""

from __future__ import annotations

import json
import os
from importlib import resources

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

import distckpt
from distckpt import ShardedObject, ShardedTensor
from distckpt.errors import CheckpointingException
from distckpt.format.index import CheckpointIndex
from distckpt.format.metadata import CheckpointMetadata
from distckpt.format.safetensors import parse_header

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "v1")


def schema(name: str) -> Draft202012Validator:
    text = resources.files("distckpt.format").joinpath(name).read_text()
    document = json.loads(text)
    Draft202012Validator.check_schema(document)
    return Draft202012Validator(document)


def checkpoint_documents(path):
    meta = json.loads(open(os.path.join(path, "metadata.json")).read())
    index = json.loads(open(os.path.join(path, meta["index"]["file"])).read())
    return meta, index


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    path = tmp_path_factory.mktemp("fresh")
    state = {
        "w": ShardedTensor.from_rank_offsets("w", torch.randn(4, 6)),
        "flat": ShardedTensor.from_rank_offsets_flat("flat", torch.arange(12.0), (3, 4), flattened_range=slice(0, 12)),
        "scalar": ShardedTensor.from_rank_offsets("scalar", torch.tensor(2)),
        "rng": ShardedObject("rng", [1, 2], (1,), (0,)),
        "step": 1,
    }
    distckpt.save(state, path, content_metadata={"iteration": 1, "tags": ["a"]})
    return str(path)


@pytest.mark.parametrize("which", ["fresh", "v1/single", "v1/two_ranks", "v2/single", "v2/two_ranks", "v2/grid"])
def test_documents_match_the_schemas(which, fresh):
    path = fresh if which == "fresh" else os.path.join(os.path.dirname(GOLDEN), which)
    meta, index = checkpoint_documents(path)
    schema("metadata.schema.json").validate(meta)
    schema("index.schema.json").validate(index)


def test_schemas_reject_path_traversal_and_wrong_versions(fresh):
    meta, index = checkpoint_documents(fresh)
    bad_index = dict(index, files=["../outside.safetensors"])
    assert not schema("index.schema.json").is_valid(bad_index)
    assert not schema("metadata.schema.json").is_valid(dict(meta, version=3))
    assert not schema("index.schema.json").is_valid(dict(index, version=3))


def _mutations():
    """JSON-level mutations of a valid document: values replaced by odd types and sizes."""
    odd = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
        st.text(max_size=20), st.lists(st.integers(-5, 2**40), max_size=4),
        st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    )
    return st.lists(st.tuples(st.integers(0, 10_000), odd), min_size=1, max_size=4)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


def _mutate(doc, mutations):
    doc = json.loads(json.dumps(doc))
    for pick, value in mutations:
        paths = [p for p in _paths(doc) if p]
        path = paths[pick % len(paths)]
        target = doc
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
    return doc


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=_mutations())
def test_index_reader_only_raises_library_errors(fresh, mutations):
    _, index = checkpoint_documents(fresh)
    raw = json.dumps(_mutate(index, mutations), allow_nan=True).encode()
    try:
        CheckpointIndex.from_json(raw, "index.json")
    except CheckpointingException:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=_mutations())
def test_metadata_reader_only_raises_library_errors(fresh, mutations):
    meta, _ = checkpoint_documents(fresh)
    raw = json.dumps(_mutate(meta, mutations), allow_nan=True).encode()
    try:
        CheckpointMetadata.from_json(raw, "metadata.json")
    except CheckpointingException:
        pass


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200))
def test_readers_survive_arbitrary_bytes(raw):
    for parse in (lambda: CheckpointIndex.from_json(raw, "i"), lambda: CheckpointMetadata.from_json(raw, "m"),
                  lambda: parse_header(raw, "d")):
        try:
            parse()
        except CheckpointingException:
            pass


def test_forged_header_length_does_not_allocate():
    forged = (2**63).to_bytes(8, "little") + b"{}"
    with pytest.raises(CheckpointingException, match="header length"):
        parse_header(forged, "data.safetensors")
