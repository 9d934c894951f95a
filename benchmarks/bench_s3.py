"""distckpt vs torch.distributed.checkpoint (DCP) on an S3 server: save and resharded load.

Starts a real SeaweedFS S3 server on 127.0.0.1 (tests/_s3.py), then on the same synthetic
state dict, world sizes and server runs distckpt (obstore client) and DCP's fsspec storage
(``FsspecWriter``/``FsspecReader`` with s3fs) alternately and prints medians and ratios:

    python benchmarks/bench_s3.py            # 128 MiB, 200 tensors, 3 repeats
    python benchmarks/bench_s3.py --quick    # 16 MiB, 20 tensors, 1 repeat

Needs ``pip install s3fs`` (the ``bench`` extra) for DCP. Saves use W=4 ranks, loads W=2
(rows split 4 ways saved, loaded as 2 column blocks and as 2 row blocks); every load is
checked bit-exact once. Results go to the section "Object store (S3)" of docs/benchmarks.md
unless --no-docs.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

from _report import replace_section  # noqa: E402
from bench import Pool, shape_for  # noqa: E402

from _s3 import S3Server  # noqa: E402

SECTION = "## Object store (S3)"
BEGIN, END = "<!-- bench_s3.py:begin -->", "<!-- bench_s3.py:end -->"
LAYOUTS = ("cols2", "rows2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--total-mib", type=int, default=128)
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-docs", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.total_mib, args.tensors, args.repeats = 16, 20, 1

    server = S3Server().start()
    os.environ.update(server.env())  # inherited by the spawned workers (obstore and s3fs alike)
    bucket = server.create_bucket()
    client = server.client()
    results: dict[str, list[float]] = {}
    try:
        put_mb_s, get_mb_s = _server_bandwidth(client, bucket)
        save_pool, load_pool = Pool(4), Pool(2)
        save_pool.wait_ready()
        load_pool.wait_ready()
        rows, cols = shape_for(args.tensors, args.total_mib << 20, 1024)
        state_bytes = sum(r["state_bytes"] for r in save_pool.call(
            "build", n=args.tensors, rows=rows, cols=cols, layouts=[]))
        load_pool.call("build", n=args.tensors, rows=rows, cols=cols, layouts=list(LAYOUTS))
        print(f"{args.tensors} tensors of [{rows}, {cols}] fp32 = {state_bytes / 2**20:.1f} MiB; "
              f"server: put {put_mb_s:.0f} MB/s, get {get_mb_s:.0f} MB/s (one 64 MiB object, boto3)")

        def url(tag: str, lib: str) -> str:
            return f"s3://{bucket}/{tag}-{lib}-{uuid.uuid4().hex[:6]}"

        sources = {}
        for lib in ("distckpt", "dcp"):  # warm-up: the load sources, checked bit-exact
            sources[lib] = url("src", lib)
            save_pool.call("save", lib=lib, path=sources[lib], mode="sync")
            for layout in LAYOUTS:
                load_pool.call("load", lib=lib, path=sources[lib], layout=layout)
                bad = [r for r in load_pool.call("check", layout=layout) if r["mismatched_count"]]
                assert not bad, f"{lib} load {layout}: wrong values"
        for rep in range(args.repeats):
            order = ("distckpt", "dcp") if rep % 2 == 0 else ("dcp", "distckpt")
            line = [f"repeat {rep + 1}/{args.repeats}:"]
            for lib in order:
                target = url("save", lib)
                t = save_pool.call("save", lib=lib, path=target, mode="sync")[0]["time"]
                results.setdefault(f"save-{lib}", []).append(t)
                line.append(f"save {lib} {t:.2f}s")
                _delete_prefix(client, bucket, target.split("/", 3)[3])
            for layout in LAYOUTS:
                for lib in order:
                    out = load_pool.call("load", lib=lib, path=sources[lib], layout=layout)
                    results.setdefault(f"load_{layout}-{lib}", []).append(out[0]["time"])
                    line.append(f"load {layout} {lib} {out[0]['time']:.2f}s")
            print(" ".join(line), flush=True)
        for pool in (save_pool, load_pool):
            pool.call("close")
            pool.close()
    finally:
        server.close()

    table = _table(results, state_bytes, put_mb_s, get_mb_s)
    command = "python benchmarks/bench_s3.py" + (" --quick" if args.quick else "")
    print("\n" + table)
    if not args.no_docs:
        _write_docs(table, command, args, state_bytes, rows, cols)


def _server_bandwidth(client, bucket: str) -> tuple[float, float]:
    """The server's own put/get speed for one 64 MiB object (the physical limit here): the best
    of 3, after a warm-up put (a fresh server allocates its volumes on the first write)."""
    payload = os.urandom(64 << 20)
    client.put_object(Bucket=bucket, Key="bandwidth-probe", Body=payload[: 1 << 20])
    puts, gets = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        client.put_object(Bucket=bucket, Key="bandwidth-probe", Body=payload)
        t1 = time.perf_counter()
        client.get_object(Bucket=bucket, Key="bandwidth-probe")["Body"].read()
        t2 = time.perf_counter()
        puts.append(len(payload) / (t1 - t0) / 1e6)
        gets.append(len(payload) / (t2 - t1) / 1e6)
    client.delete_object(Bucket=bucket, Key="bandwidth-probe")
    return max(puts), max(gets)


def _delete_prefix(client, bucket: str, prefix: str) -> None:
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])]
    for start in range(0, len(keys), 1000):
        client.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]]})


def _table(results: dict[str, list[float]], state_bytes: int, put: float, get: float) -> str:
    lines = ["| metric | distckpt | DCP (fsspec/s3fs) | DCP / distckpt |", "|---|---:|---:|---:|"]
    labels = {"save": "sync save, W=4", "load_cols2": "load rows 4 → cols 2", "load_rows2": "load rows 4 → rows 2"}
    for metric, label in labels.items():
        ours = statistics.median(results[f"{metric}-distckpt"])
        theirs = statistics.median(results[f"{metric}-dcp"])
        mb_s = state_bytes / ours / 1e6
        lines.append(f"| {label} | {ours:.3f} s ({mb_s:.0f} MB/s) | {theirs:.3f} s | {theirs / ours:.2f} |")
    lines.append(f"| server alone, one 64 MiB object, best of 3 (boto3) | put {put:.0f} MB/s | get {get:.0f} MB/s | |")
    return "\n".join(lines)


def _write_docs(table: str, command: str, args, state_bytes: int, rows: int, cols: int) -> None:
    path = os.path.join(REPO, "docs", "benchmarks.md")
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    generated = "\n".join([
        BEGIN,
        f"Command: `{command}` — run {datetime.date.today().isoformat()} on commit `{commit}`, "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}. "
        f"{args.tensors} tensors of [{rows}, {cols}] fp32 ({state_bytes / 2**20:.0f} MiB), "
        f"medians of {args.repeats} alternating runs; server, clients and ranks share the machine.",
        "",
        table,
        END,
    ])
    replace_section(path, SECTION, BEGIN, END, generated)


if __name__ == "__main__":
    main()
