"""Helpers for nested state dicts (dicts and lists of arbitrary depth), as in Megatron-Core."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch


def extract_matching_values(
    x: dict | list, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[dict | list, dict | list]:
    """Split a nested structure in two: the leaves matching ``predicate`` and the rest.

    Both results keep the nesting of ``x``; containers left empty are dropped. With
    ``return_lists_as_dicts`` lists come back as ``{index: value}`` dicts so positions survive.
    """

    def _set(container, key, value):
        if isinstance(container, dict):
            container[key] = value
        else:
            container.append(value)

    items: Any
    if isinstance(x, dict):
        matching: dict | list = {}
        nonmatching: dict | list = {}
        items = x.items()
    elif isinstance(x, list):
        if return_lists_as_dicts:
            matching, nonmatching = {}, {}
        else:
            matching, nonmatching = [], []
        items = enumerate(x)
    else:
        raise TypeError(f"expected a dict or a list, got {type(x).__name__}")

    for key, value in items:
        if isinstance(value, (dict, list)):
            sub_match, sub_rest = extract_matching_values(value, predicate, return_lists_as_dicts)
            if sub_match:
                _set(matching, key, sub_match)
            if sub_rest or not sub_match:
                _set(nonmatching, key, sub_rest)
        elif predicate(value):
            _set(matching, key, value)
        else:
            _set(nonmatching, key, value)
    return matching, nonmatching


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """Compare two nested structures.

    Returns ``(only_left, only_right, mismatch)``: key paths present only in ``x1``, only in
    ``x2``, and paths whose values differ (as ``(path, type1, type2)``). Tensors compare by
    dtype, shape and values.
    """
    mismatch: list = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            left, right, sub = diff(x1[k], x2[k], prefix + (k,))
            only_left.extend(left)
            only_right.extend(right)
            mismatch.extend(sub)
        return only_left, only_right, mismatch
    if isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (a, b) in enumerate(zip(x1, x2)):
            left, right, sub = diff(a, b, prefix + (i,))
            only_left.extend(left)
            only_right.extend(right)
            mismatch.extend(sub)
        return only_left, only_right, mismatch
    if isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
        equal = (
            isinstance(x1, torch.Tensor)
            and isinstance(x2, torch.Tensor)
            and x1.dtype == x2.dtype
            and x1.shape == x2.shape
            and bool(torch.equal(x1.cpu(), x2.cpu()))
        )
    else:
        try:
            equal = bool(x1 == x2)
        except Exception:  # objects whose __eq__ is ambiguous (e.g. numpy arrays)
            equal = False
    if not equal:
        mismatch.append((prefix, type(x1), type(x2)))
    return [], [], mismatch


def nested_items_iter(x: dict | list) -> Iterator[tuple[Any, Any]]:
    """Yield ``(key, leaf)`` for every leaf, where key is the leaf's key in its container."""
    items = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield k, v


def nested_values(x: dict | list) -> Iterator[Any]:
    """Yield every leaf of a nested structure."""
    for _, v in nested_items_iter(x):
        yield v


def dict_map(f: Callable[[Any], Any], x: dict) -> None:
    """Apply ``f`` to every leaf of nested dicts, in place (lists are leaves)."""
    for k, v in x.items():
        if isinstance(v, dict):
            dict_map(f, v)
        else:
            x[k] = f(v)


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Apply ``f`` to every leaf of nested dicts and lists, in place; returns ``x``."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = (dict_list_map_inplace(f, v) for v in x)
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Like :func:`dict_list_map_inplace` but builds new containers."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: dict | list, x2: dict | list, key: tuple = ()) -> dict | list:
    """Merge ``x2`` into ``x1`` in place (recursively) and return ``x1``.

    Lists are merged element-wise and must have equal lengths, except that an empty list takes
    the other one (a rank holding no shard of a list leaves an empty list in the common state);
    a leaf present in both is overwritten by ``x2``'s.
    """
    if isinstance(x1, list) and not x1:
        return x2
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                x1[k] = v2
            else:
                x1[k] = merge(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"cannot merge lists of different lengths ({len(x1)} and {len(x2)}) at key {key}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key=key + (i,))
    else:
        return x2
    return x1


def map_reduce(
    xs: list,
    key_fn: Callable[[Any], Any] = lambda x: x,
    value_fn: Callable[[Any], Any] = lambda x: x,
    reduce_fn: Callable[[list], Any] = lambda x: x,
) -> dict:
    """Group ``xs`` by ``key_fn``, map values with ``value_fn``, reduce each group."""
    groups: dict = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
