"""The ``distckpt`` command: inspect, verify and unshard checkpoints without writing code."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence

from .engine.checkpoint import CheckpointReader
from .engine.verify import verify_checkpoint
from .errors import CheckpointingException
from .format.dtypes import dtype_from_name, itemsize


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _inspect_data(reader: CheckpointReader) -> dict:
    meta = reader.metadata
    index = reader.index
    tensors = []
    for key, entry in index.tensors.items():
        nbytes = math.prod(entry.shape) * itemsize(dtype_from_name(entry.dtype))
        tensors.append(
            {"key": key, "dtype": entry.dtype, "shape": list(entry.shape), "bytes": nbytes,
             "chunks": entry.num_chunks}
        )
    objects = [
        {"key": uk, "grid": list(o.global_shape), "bytes": o.nbytes} for uk, o in index.objects.items()
    ]
    common_keys: list[str] | str
    try:
        from .serialization import load_common_state_dict

        common = load_common_state_dict(reader.storage)
        common_keys = sorted(map(str, common)) if isinstance(common, dict) else [type(common).__name__]
    except CheckpointingException as exc:
        common_keys = f"(not shown: {exc})"
    return {
        "path": reader.path,
        "format": meta.format,
        "version": meta.version,
        "save_id": meta.save_id,
        "created": meta.created,
        "writer": meta.writer,
        "world_size": meta.world_size,
        "backends": {"sharded": [meta.sharded_backend, meta.sharded_backend_version],
                     "common": [meta.common_backend, meta.common_backend_version]},
        "content_metadata": meta.content_metadata,
        "common_keys": common_keys,
        "tensors": tensors,
        "objects": objects,
        "totals": {
            "tensors": len(tensors),
            "tensor_bytes": sum(t["bytes"] for t in tensors),
            "chunks": sum(t["chunks"] for t in tensors),
            "objects": len(objects),
            "files": len(index.files),
            "common_bytes": meta.common.nbytes,
        },
    }


def _print_inspect(info: dict) -> None:
    print(f"checkpoint  {info['path']}")
    print(f"format      {info['format']} v{info['version']}  (save {info['save_id']}, "
          f"{info['created']}, {info['writer']}, saved by {info['world_size']} ranks)")
    print(f"content     {json.dumps(info['content_metadata'])}")
    keys = info["common_keys"]
    print(f"common      {', '.join(keys) if isinstance(keys, list) else keys}")
    rows = [(t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", _human(t["bytes"]), str(t["chunks"]))
            for t in info["tensors"]]
    header = ("tensor", "dtype", "global shape", "bytes", "chunks")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(5)]
    print()
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
    if info["objects"]:
        print()
        print("objects")
        for o in info["objects"]:
            print(f"  {o['key']}  grid {'x'.join(map(str, o['grid']))}  {_human(o['bytes'])}")
    t = info["totals"]
    print()
    print(f"total       {t['tensors']} tensors, {_human(t['tensor_bytes'])} in {t['chunks']} chunks, "
          f"{t['objects']} objects, {t['files']} data files, common state {_human(t['common_bytes'])}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distckpt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_inspect = sub.add_parser("inspect", help="list tensors, objects, common keys and metadata")
    p_inspect.add_argument("dir")
    p_inspect.add_argument("--json", action="store_true", help="machine-readable output")
    p_verify = sub.add_parser("verify", help="re-read every chunk and check its checksum")
    p_verify.add_argument("dir")
    p_unshard = sub.add_parser(
        "unshard", help="write the model (and optimizer) state as torch.load-able or safetensors files"
    )
    p_unshard.add_argument("dir", help="checkpoint saved with distckpt.checkpoint.save_model_and_optim_state")
    p_unshard.add_argument("out", help="local output directory")
    p_unshard.add_argument("--safetensors", action="store_true", help="write safetensors files (model only)")
    p_unshard.add_argument("--strategy", choices=["one_file", "one_file_per_tensor", "chunks"], default="one_file")
    p_unshard.add_argument("--chunk-size", type=_parse_size, default=None,
                           help="approximate file size for --strategy chunks, e.g. 1GB, 500MiB")
    p_unshard.add_argument("--no-optim", action="store_true", help="skip the optimizer state")
    p_unshard.add_argument("--overwrite", action="store_true", help="replace files in a non-empty OUT")
    p_unshard.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    if args.command == "unshard":
        return _unshard(parser, args)

    if args.command == "inspect":
        try:
            info = _inspect_data(CheckpointReader(args.dir))
        except CheckpointingException as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            _print_inspect(info)
        return 0

    report = verify_checkpoint(args.dir)
    for problem in report.problems:
        print(f"FAIL  {problem}")
    if report.ok:
        print(f"OK    {report.path}: {report.chunks} chunks in {report.files} files, "
              f"{_human(report.bytes_checked)} checked")
        return 0
    print(f"{len(report.problems)} problem(s) in {report.path}", file=sys.stderr)
    return 1


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def _parse_size(text: str) -> int:
    """``"1GB"``, ``"500MiB"``, ``"4096"`` -> bytes."""
    upper = text.strip().upper()
    digits = upper.rstrip("KMGTIB")
    unit = upper[len(digits):]
    try:
        value = float(digits) * _UNITS[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 1GB, 500MiB, 4096)") from None
    if int(value) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be at least one byte")
    return int(value)


def _unshard(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .checkpoint import UnshardStrategy, unshard_checkpoint

    if args.strategy == "chunks" and args.chunk_size is None:
        parser.error("--strategy chunks needs --chunk-size (e.g. --chunk-size 1GB)")
    strategy = {
        "one_file": UnshardStrategy.one_file,
        "one_file_per_tensor": UnshardStrategy.one_file_per_tensor,
        "chunks": lambda: UnshardStrategy.chunks(args.chunk_size),
    }[args.strategy]()
    try:
        model, optim = unshard_checkpoint(
            args.dir, args.out, optim=not (args.no_optim or args.safetensors),
            save_overwrite=args.overwrite, use_safetensors=args.safetensors,
            unshard_strategy=strategy, quiet=args.quiet,
        )
    except FileExistsError:
        print(f"error: {args.out} is not empty; pass --overwrite to replace its files", file=sys.stderr)
        return 1
    except (CheckpointingException, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"model: {model}")
    if optim is not None:
        print(f"optim: {optim}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
