"""distckpt vs torch.distributed.checkpoint (DCP): save, resharding load, async save.

One command, same synthetic state dict, same world sizes, same disk, libraries interleaved:

    python benchmarks/bench.py            # full run (256 MiB, 200 and 2000 tensors, 5 repeats)
    python benchmarks/bench.py --quick    # smoke run (16 MiB, 20 and 200 tensors, 1 repeat)

Workers are spawned once per world size (W=4 saves, W=2 loads) and reused, so process start-up
is never timed. Every timed region runs between two barriers and is timed on rank 0. The page
cache is dropped before every timed load when permitted (root). Results: a markdown table on
stdout and, unless --no-docs, the generated part of the section "Save and load vs
torch.distributed.checkpoint" of docs/benchmarks.md (text outside the markers is kept).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import torch
import torch.multiprocessing as mp
from _disk import drop_page_cache, measure_disk

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECTION = "## Save and load vs torch.distributed.checkpoint"
BEGIN, END = "<!-- bench.py:begin -->", "<!-- bench.py:end -->"
LIBS = ("distckpt", "dcp")
LAYOUTS = ("cols2", "rows2")  # load layouts; the save layout is always rows split over W=4
LAYOUT_TEXT = {"cols2": "rows 4 → cols 2", "rows2": "rows 4 → rows 2"}
LIB_TEXT = {"distckpt": "distckpt", "dcp": "DCP"}


# -- worker pools ------------------------------------------------------------------------------


class Pool:
    """``world`` persistent worker processes forming one gloo group."""

    def __init__(self, world: int) -> None:
        from _bench_worker import worker_main  # imports distckpt: only after --commit took effect

        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        port = _free_port()
        self.procs = [
            ctx.Process(target=worker_main, args=(r, world, port, self.commands[r], self.results), daemon=True)
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def wait_ready(self) -> None:
        self._collect("start")

    def call(self, name: str, **kwargs) -> list[dict]:
        for q in self.commands:
            q.put((name, kwargs))
        return self._collect(name)

    def _collect(self, name: str, timeout: float = 900.0) -> list:
        out: list = [None] * self.world
        deadline = time.monotonic() + timeout
        for _ in range(self.world):
            while True:
                try:
                    rank, status, payload = self.results.get(timeout=5)
                    break
                except queue.Empty:
                    dead = [p.pid for p in self.procs if not p.is_alive()]
                    if dead or time.monotonic() > deadline:
                        self.terminate()
                        raise RuntimeError(f"{name}: workers {dead or 'timed out'} (W={self.world})") from None
            if status == "error":
                self.terminate()
                raise RuntimeError(f"{name} failed on rank {rank} (W={self.world}):\n{payload}")
            out[rank] = payload
        return out

    def close(self) -> None:
        for q in self.commands:
            q.put(("exit", {}))
        for p in self.procs:
            p.join(timeout=30)
        self.terminate()

    def terminate(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- measurements ------------------------------------------------------------------------------


class Samples:
    """Samples per (metric, tensor count, lib); a metric a lib cannot run is 'n/a' with a reason."""

    def __init__(self) -> None:
        self.values: dict[tuple, list[float]] = defaultdict(list)
        self.unavailable: dict[tuple, str] = {}

    def add(self, metric: str, n: int, lib: str, value: float) -> None:
        self.values[(metric, n, lib)].append(value)

    def median(self, metric: str, n: int, lib: str) -> float | None:
        v = self.values.get((metric, n, lib))
        return statistics.median(v) if v else None


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _clean(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()  # so that write-back and discards of the removed files land outside timed regions


def shape_for(n: int, total_bytes: int, cols: int) -> tuple[int, int]:
    """[rows, cols] fp32 with rows a multiple of 4 (split 4 and 2 ways) and n tensors totalling
    about ``total_bytes``."""
    rows = max(4, round(total_bytes / 4 / n / cols / 4) * 4)
    return rows, cols


def run_benchmark(args, samples: Samples, facts: dict) -> None:
    root = args.dir
    drop_ok = drop_page_cache()
    facts["page_cache_drop"] = drop_ok
    print(f"page cache drop before loads: {'yes' if drop_ok else 'NOT PERMITTED (loads may hit the page cache)'}")
    save_pool, load_pool = Pool(args.save_world), Pool(args.load_world)
    save_pool.wait_ready()
    load_pool.wait_ready()
    try:
        for n in args.tensors:
            _run_tensor_count(args, n, save_pool, load_pool, samples, facts, drop_ok, root)
        for pool in (save_pool, load_pool):
            for r in pool.call("close"):
                if r.get("warning"):
                    print(f"warning: {r['warning']}")
    finally:
        save_pool.close()
        load_pool.close()


def _run_tensor_count(args, n, save_pool, load_pool, samples, facts, drop_ok, root) -> None:
    rows, cols = shape_for(n, args.total_mib << 20, args.cols)
    state_bytes = sum(r["state_bytes"] for r in save_pool.call("build", n=n, rows=rows, cols=cols, layouts=[]))
    load_pool.call("build", n=n, rows=rows, cols=cols, layouts=list(LAYOUTS))
    facts.setdefault("shapes", {})[n] = {"shape": [rows, cols], "total_bytes": state_bytes}
    print(f"\n== {n} tensors of [{rows}, {cols}] fp32 = {state_bytes / 2**20:.1f} MiB, "
          f"save W={args.save_world}, load W={args.load_world}")
    libs = list(args.libs)

    def save(lib: str, mode: str, tag: str, profile: str | None = None, keep: bool = False,
             mutate: bool = False) -> dict | None:
        path = os.path.join(root, f"{tag}-{lib}-{n}")
        _clean(path)
        out = save_pool.call("save", lib=lib, path=path, mode=mode, profile=profile,
                             dcp_plan_caching=args.dcp_plan_caching, mutate_while_writing=mutate)
        if any("unavailable" in r for r in out):
            reason = next(r["unavailable"] for r in out if "unavailable" in r)
            samples.unavailable[(f"{mode}_save", n, lib)] = reason
            _clean(path)
            return None
        if tag == "src":
            facts.setdefault("disk_bytes", {})[f"{lib}-{n}"] = _dir_bytes(path)
        elif not keep:
            _clean(path)
        return {
            "time": out[0]["time"],
            "block": max(r["block"] for r in out),
            "rss_mb": max(r["rss_growth_kb"] for r in out) / 1024,
            "retained_mb": max(r["rss_retained_kb"] for r in out) / 1024,
            "fsyncs": sum(r["fsyncs"] for r in out),
            "write_bytes": sum(r["write_bytes"] for r in out),
            "peak_reset": all(r["peak_reset"] for r in out),
        }

    def load(lib: str, layout: str, profile: str | None = None, tag: str = "src") -> dict:
        if drop_ok:
            drop_page_cache()
        out = load_pool.call("load", lib=lib, path=os.path.join(root, f"{tag}-{lib}-{n}"), layout=layout,
                             profile=profile)
        return {
            "time": out[0]["time"],
            "rss_mb": max(r["rss_growth_kb"] for r in out) / 1024,
            "rchar_mb": max(r["rchar"] for r in out) / 2**20,
            "disk_read_mb": sum(r["read_bytes"] for r in out) / 2**20,
            "loopback_mb": out[0]["lo_bytes"] / 2**20,
            "needed_mb": max(r["needed_bytes"] for r in out) / 2**20,
        }

    def check(lib: str, layout: str, what: str) -> None:
        bad = [r for r in load_pool.call("check", layout=layout) if r["mismatched_count"]]
        if bad:
            raise RuntimeError(f"{lib} {what}, load {layout}: wrong values, e.g. {bad[0]['mismatched']}")

    # Warm-up (untimed): the load sources, one load per layout with a bit-exact check, and one
    # async save per library (first-call costs such as thread or process start-up) whose
    # tensors are modified while it writes: it must still load bit-exact.
    for lib in libs:
        first = save(lib, "sync", "src")
        assert first is not None, f"{lib} sync save unavailable"
        facts.setdefault("fsyncs_per_save", {})[f"{lib}-{n}"] = first["fsyncs"]
        facts["peak_rss_reset"] = first["peak_reset"]
        for layout in LAYOUTS:
            load(lib, layout)
            check(lib, layout, "sync save")
        warm = save(lib, "async", "warm", keep=True, mutate=True)
        if warm is not None:
            load(lib, "rows2", tag="warm")
            check(lib, "rows2", "async save with tensors modified while writing")
            _clean(os.path.join(root, f"warm-{lib}-{n}"))
            samples.add("async_first_rss", n, lib, warm["rss_mb"])
            samples.add("async_first_retained", n, lib, warm["retained_mb"])
    print("   warm-up done; loads checked bit-exact; fsync calls per save (all ranks): "
          + ", ".join(f"{LIB_TEXT[lib]} {facts['fsyncs_per_save'][f'{lib}-{n}']}" for lib in libs))

    for rep in range(args.repeats):
        order = libs if rep % 2 == 0 else libs[::-1]
        line = [f"   repeat {rep + 1}/{args.repeats}:"]
        for lib in order:
            r = save(lib, "sync", "sync")
            if r is not None:
                samples.add("sync_save", n, lib, r["time"])
                samples.add("sync_save_rss", n, lib, r["rss_mb"])
                samples.add("sync_save_fsyncs", n, lib, r["fsyncs"])
                line.append(f"save {lib} {r['time']:.2f}s")
        for lib in order:
            if (("async_save", n, lib)) in samples.unavailable:
                continue
            r = save(lib, "async", "async")
            if r is not None:
                samples.add("async_block", n, lib, r["block"])
                samples.add("async_total", n, lib, r["time"])
                samples.add("async_save_rss", n, lib, r["rss_mb"])
                line.append(f"async {lib} {r['block']:.2f}/{r['time']:.2f}s")
        for into_buffers, ref in ((False, "clone"), (True, "copy")):
            c = save_pool.call("clone", into_buffers=into_buffers)
            samples.add(ref, n, "ref", c[0]["time"])
            samples.add(f"{ref}_rss", n, "ref", max(r["rss_growth_kb"] for r in c) / 1024)
        for layout in LAYOUTS:
            for lib in order:
                r = load(lib, layout)
                samples.add(f"load_{layout}", n, lib, r["time"])
                samples.add(f"load_{layout}_rss", n, lib, r["rss_mb"])
                samples.add(f"load_{layout}_rchar", n, lib, r["rchar_mb"])
                samples.add(f"load_{layout}_disk_read", n, lib, r["disk_read_mb"])
                samples.add(f"load_{layout}_loopback", n, lib, r["loopback_mb"])
                samples.add(f"load_{layout}_needed", n, lib, r["needed_mb"])
                line.append(f"load {layout} {lib} {r['time']:.2f}s")
        print(" ".join(line), flush=True)

    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        for lib in libs:
            stem = os.path.join(args.profile, f"{n}-{lib}")
            save(lib, "sync", "prof", profile=f"{stem}-sync_save.prof")
            if ("async_save", n, lib) not in samples.unavailable:
                save(lib, "async", "prof", profile=f"{stem}-async_save.prof")
            for layout in LAYOUTS:
                load(lib, layout, profile=f"{stem}-load_{layout}.prof")
        print(f"   cProfile stats of rank 0 in {args.profile}/{n}-*.prof")
    for lib in libs:
        _clean(os.path.join(root, f"src-{lib}-{n}"))


# -- report ------------------------------------------------------------------------------------


def _fmt_s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f} s"


def _ratio(dcp: float | None, ours: float | None) -> str:
    if dcp is None or ours is None or ours == 0:
        return "n/a"
    return f"{dcp / ours:.2f}"


def render_table(args, samples: Samples, facts: dict) -> str:
    libs = [lib for lib in LIBS if lib in args.libs]
    lines = [
        "| metric | tensors | distckpt | DCP | DCP / distckpt |",
        "|---|---:|---:|---:|---:|",
    ]
    disk_w = facts["disk"]["write_limit"]

    def row(label: str, n: int, cells: dict[str, str], ratio: str = "") -> None:
        lines.append(f"| {label} | {n} | {cells.get('distckpt', '—')} | {cells.get('dcp', '—')} | {ratio} |")

    def metric_rows(metric: str, label: str, fmt, ratio_from: float | None = 0.0) -> None:
        """One row per tensor count: medians formatted by ``fmt(value, n)``, and the ratio DCP /
        ours when both medians are at least ``ratio_from`` (None: no ratio)."""
        group = "async_save" if metric.startswith("async") else metric
        for n in args.tensors:
            meds = {lib: samples.median(metric, n, lib) for lib in libs}
            cells = {
                lib: (fmt(m, n) if m is not None else
                      "n/a¹" if (group, n, lib) in samples.unavailable else "n/a")
                for lib, m in meds.items()
            }
            small = ratio_from is None or any(m is not None and m < ratio_from for m in meds.values())
            row(label, n, cells, "—" if small else _ratio(meds.get("dcp"), meds.get("distckpt")))

    def seconds(v: float, n: int) -> str:
        return f"{v:.3f} s"

    def per_rank(world: int):
        def fmt(v: float, n: int) -> str:
            state = facts["shapes"][n]["total_bytes"] / world
            return f"{v:.{0 if v >= 10 else 1}f} MB ({100 * v * 2**20 / state:.0f} %)"
        return fmt

    metric_rows("sync_save", f"sync save, W={args.save_world}, fsync (time)", seconds)
    metric_rows("sync_save", "sync save throughput (% of disk O_DIRECT write)",
                lambda v, n: f"{facts['shapes'][n]['total_bytes'] / v / 1e9:.2f} GB/s "
                             f"({100 * facts['shapes'][n]['total_bytes'] / v / 1e9 / disk_w:.0f} %)")
    for layout in LAYOUTS:
        metric_rows(f"load_{layout}", f"load W={args.load_world}, {LAYOUT_TEXT[layout]} (time, cold cache)", seconds)
    metric_rows("async_block", "async save: blocking (max over ranks)", seconds)
    metric_rows("async_total", "async save: total, until committed", seconds)
    mb = 1.0  # memory ratios of values below 1 MB are noise
    metric_rows("sync_save_rss", "peak RSS growth per rank, sync save (% of state/rank)",
                per_rank(args.save_world), mb)
    metric_rows("async_first_rss", "peak RSS growth per rank, first async save", per_rank(args.save_world), mb)
    metric_rows("async_save_rss", "peak RSS growth per rank, later async saves", per_rank(args.save_world), mb)
    metric_rows("async_first_retained", "RSS still held per rank after the first async save",
                per_rank(args.save_world), mb)
    for layout in LAYOUTS:
        metric_rows(f"load_{layout}_rss", f"peak RSS growth per rank, load {LAYOUT_TEXT[layout]} (% of request)",
                    per_rank(args.load_world), mb)
    for layout in LAYOUTS:
        needed = f"load_{layout}_needed"
        metric_rows(f"load_{layout}_rchar", f"bytes read per rank (rchar), load {LAYOUT_TEXT[layout]} (× needed)",
                    lambda v, n, needed=needed: f"{v:.0f} MiB ({v / samples.median(needed, n, libs[0]):.2f}×)")
    if facts["page_cache_drop"]:
        for layout in LAYOUTS:
            metric_rows(f"load_{layout}_disk_read", f"bytes read from disk, all ranks, load {LAYOUT_TEXT[layout]}",
                        lambda v, n: f"{v:.0f} MiB")
    for layout in LAYOUTS:
        metric_rows(f"load_{layout}_loopback", f"loopback (gloo) traffic, all ranks, load {LAYOUT_TEXT[layout]}",
                    lambda v, n: f"{v:.1f} MiB", None)
    for n in args.tensors:
        sizes = {lib: facts.get("disk_bytes", {}).get(f"{lib}-{n}") for lib in libs}
        cells = {lib: f"{v / 2**20:.1f} MiB" for lib, v in sizes.items() if v is not None}
        row("checkpoint size on disk", n, cells, _ratio(sizes.get("dcp"), sizes.get("distckpt")))
    for n in args.tensors:
        cells = {lib: str(facts["fsyncs_per_save"].get(f"{lib}-{n}", "n/a")) for lib in libs}
        row("fsync calls per sync save (all ranks)", n, cells)
    return "\n".join(lines)


def render_reference(args, samples: Samples, facts: dict) -> str:
    d = facts["disk"]
    lines = [
        "| reference | value |",
        "|---|---:|",
        f"| disk, O_DIRECT write, 1 / 4 streams | {d['direct_write_1']:.2f} / {d['direct_write_4']:.2f} GB/s |",
        f"| disk, O_DIRECT read, 1 / 4 streams | {d['direct_read_1']:.2f} / {d['direct_read_4']:.2f} GB/s |",
        f"| disk, buffered write + fsync, 1 stream | {d['buffered_write_fsync_1']:.2f} GB/s |",
    ]
    if "buffered_cold_read_1" in d:
        lines.append(f"| disk, buffered read after cache drop, 1 stream | {d['buffered_cold_read_1']:.2f} GB/s |")
    for n in args.tensors:
        t = samples.median("clone", n, "ref")
        rss = samples.median("clone_rss", n, "ref")
        lines.append(f"| `clone()` of every tensor (fresh memory), W={args.save_world}, {n} tensors "
                     f"| {_fmt_s(t)}, +{rss:.0f} MB/rank |")
        t = samples.median("copy", n, "ref")
        lines.append(f"| `copy_()` of every tensor into preallocated buffers, W={args.save_world}, {n} tensors "
                     f"| {_fmt_s(t)} |")
    return "\n".join(lines)


def render_section_body(args, samples: Samples, facts: dict, table: str, reference: str) -> str:
    unavailable = sorted({reason for reason in samples.unavailable.values()})
    notes = [f"¹ n/a: {r}" for r in unavailable]
    shapes = ", ".join(f"{n} × [{s['shape'][0]}, {s['shape'][1]}]" for n, s in facts["shapes"].items())
    return "\n".join([
        BEGIN,
        f"Command: `{facts['command']}` — {facts['date']}, distckpt commit `{facts['commit']}` "
        f"(`src/` last changed in `{facts['src_commit']}`)"
        f"{' (with uncommitted changes)' if facts['dirty'] else ''}.",
        "",
        f"Machine: {facts['nproc']} CPUs ({facts['cpu']}), {facts['ram_gib']:.0f} GiB RAM, "
        f"Python {facts['python']}, torch {facts['torch']}, {facts['fs']} on `{facts['device']}`; "
        f"load average at start {facts['loadavg']}. Page cache dropped before each timed load: "
        f"{'yes' if facts['page_cache_drop'] else 'no (not root)'}.",
        "",
        f"State: fp32, {shapes} (≈{args.total_mib} MiB total); saved by W={args.save_world} "
        f"(rows split 4 ways, `ShardedTensor.from_rank_offsets(key, t, (0, rank, 4))` / "
        f"`DTensor` `Shard(0)`), loaded by W={args.load_world} in another layout. "
        f"Medians of {args.repeats} interleaved repeats (library order alternates), after an untimed warm-up; "
        "times are rank 0's, barrier to barrier. Ratio = DCP / distckpt: above 1 distckpt is faster "
        "(or uses less memory / reads fewer bytes).",
        "",
        "How: DCP runs with its defaults — `FileSystemWriter` (`sync_files=True`, one file per rank, "
        "one thread), `FileSystemReader`, `async_save` with its thread executor and default stager "
        f"on a dedicated gloo group, save-plan caching {'ON' if args.dcp_plan_caching else 'off'}; "
        "distckpt with `save(..., async_sharded_save=True)` + `AsyncCallsQueue`. Both fsync: every "
        "`os.fsync` call is counted. Async blocking time is until the call returns (max over ranks); "
        "total is until the checkpoint is committed. In the untimed warm-up every tensor is modified "
        "as soon as the async save returns and the checkpoint must still load bit-exact. Peak RSS "
        "growth: VmHWM after the operation minus VmRSS before it (peak reset through "
        f"`/proc/self/clear_refs`{'' if facts.get('peak_rss_reset', True) else ' — NOT permitted here: lower bound only'}, "
        "freed heap returned with `malloc_trim` first); RSS held: VmRSS after the save, once "
        "collected and trimmed, minus VmRSS before. rchar (`/proc/self/io`) counts every read "
        "syscall, page-cache hits and sockets included; disk bytes are `read_bytes` summed over "
        "ranks; loopback traffic is `/proc/net/dev` (machine-wide).",
        "",
        table,
        "",
        reference,
        "",
        *notes,
        END,
    ])


def write_docs(path: str, body: str) -> None:
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if SECTION in text:
        start = text.index(SECTION)
        if BEGIN in text[start:] and END in text[start:]:
            b = text.index(BEGIN, start)
            e = text.index(END, b) + len(END)
            text = text[:b] + body + text[e:]
        else:
            head_end = start + len(SECTION)
            text = text[:head_end] + "\n\n" + body + "\n" + text[head_end:]
    else:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{body}\n"
    with open(path, "w") as f:
        f.write(text)


# -- main --------------------------------------------------------------------------------------


def machine_facts(args) -> dict:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "?"

    import distckpt

    meminfo = open("/proc/meminfo").read().split()
    cpu = "?"
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    df = run(["df", "--output=source,fstype", args.dir]).splitlines()
    device, fs = (df[-1].split() + ["?", "?"])[:2] if df else ("?", "?")
    return {
        "command": " ".join(["python", "benchmarks/bench.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": run(["git", "rev-parse", "--short", args.commit or "HEAD"]),
        "src_commit": run(["git", "log", "-1", "--format=%h", args.commit or "HEAD", "--", "src"]),
        "dirty": not args.commit and bool(run(["git", "status", "--porcelain", "--", "src"])),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": int(meminfo[meminfo.index("MemTotal:") + 1]) / 2**20,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device,
        "fs": fs,
        "loadavg": " ".join(open("/proc/loadavg").read().split()[:3]),
        "distckpt_path": os.path.dirname(distckpt.__file__),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 16 MiB, 20 and 200 tensors, 1 repeat")
    p.add_argument("--total-mib", type=int, default=256, help="total state size (default 256)")
    p.add_argument("--tensors", type=lambda s: [int(x) for x in s.split(",")], default=[200, 2000],
                   help="tensor counts, comma-separated, same total bytes (default 200,2000)")
    p.add_argument("--cols", type=int, default=256, help="columns of every tensor (even; default 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per library (default 5)")
    p.add_argument("--libs", type=lambda s: s.split(","), default=list(LIBS), help="distckpt,dcp")
    p.add_argument("--save-world", type=int, default=4, choices=[4])
    p.add_argument("--load-world", type=int, default=2, choices=[2])
    p.add_argument("--disk-mib", type=int, default=1024, help="bytes per disk bandwidth probe (default 1024)")
    p.add_argument("--disk-rounds", type=int, default=2, help="disk probe rounds, median (default 2)")
    p.add_argument("--dir", default="/tmp/distckpt-bench", help="scratch directory on the disk to measure")
    p.add_argument("--docs", default=os.path.join(REPO, "docs", "benchmarks.md"), help="where to write results")
    p.add_argument("--no-docs", action="store_true", help="print only (default for --quick)")
    p.add_argument("--json", help="also write every sample to this JSON file")
    p.add_argument("--dcp-plan-caching", action="store_true",
                   help="DCP saves with DefaultSavePlanner(enable_plan_caching=True) (off by default in DCP)")
    p.add_argument("--commit", metavar="REV", help="benchmark distckpt's src/ as of this commit (exported "
                   "with git archive) instead of the working tree")
    p.add_argument("--profile", metavar="DIR", help="after the timed repeats, one extra run of each operation "
                   "under cProfile (rank 0) written to DIR")
    args = p.parse_args(argv)
    if args.quick:
        args.total_mib, args.repeats, args.disk_mib, args.disk_rounds = 16, 1, 128, 1
        if args.tensors == [200, 2000]:
            args.tensors = [20, 200]
        args.no_docs = True
    if args.cols % 2:
        p.error("--cols must be even")
    return args


def use_commit(rev: str, directory: str) -> None:
    """Export src/ at ``rev`` into ``directory`` and import distckpt from there (here and in the
    spawned workers, which inherit sys.path)."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=REPO, capture_output=True, check=True).stdout
    os.makedirs(directory, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    sys.path.insert(0, os.path.join(directory, "src"))


def main(argv=None) -> None:
    args = parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    if args.commit:
        use_commit(args.commit, os.path.join(args.dir, "code"))
    facts = machine_facts(args)
    print(f"{facts['date']}  commit {facts['commit']}  torch {facts['torch']}  {facts['nproc']} CPUs  "
          f"{facts['ram_gib']:.0f} GiB  {facts['fs']} {facts['device']}  load {facts['loadavg']}")
    start = time.perf_counter()
    facts["disk"] = measure_disk(os.path.join(args.dir, "disk"), args.disk_mib, args.disk_rounds)
    d = facts["disk"]
    print(f"disk: O_DIRECT write {d['direct_write_1']:.2f} (1 stream) / {d['direct_write_4']:.2f} (4) GB/s, "
          f"read {d['direct_read_1']:.2f} / {d['direct_read_4']:.2f} GB/s, buffered write+fsync "
          f"{d['buffered_write_fsync_1']:.2f} GB/s")
    samples = Samples()
    try:
        run_benchmark(args, samples, facts)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    facts["seconds"] = time.perf_counter() - start
    table = render_table(args, samples, facts)
    reference = render_reference(args, samples, facts)
    print(f"\n{table}\n\n{reference}\n")
    for key, reason in sorted(samples.unavailable.items()):
        if key[0] == "async_save":
            print(f"n/a: {LIB_TEXT[key[2]]} async save, {key[1]} tensors: {reason}")
    print(f"total {facts['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"facts": facts,
                       "samples": {"|".join(map(str, k)): v for k, v in samples.values.items()},
                       "unavailable": {"|".join(map(str, k)): v for k, v in samples.unavailable.items()}},
                      f, indent=1, default=str)
    if not args.no_docs:
        write_docs(args.docs, render_section_body(args, samples, facts, table, reference))
        print(f"wrote {os.path.relpath(args.docs, REPO)} ({SECTION[3:]})")


if __name__ == "__main__":
    main()
