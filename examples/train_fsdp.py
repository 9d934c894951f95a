"""A real training loop with distckpt.checkpoint: train a small transformer with FSDP2 on 4
processes, checkpoint it, resume on 2 processes and continue, then unshard the checkpoint to
safetensors and load it with the ``safetensors`` package in a plain single process.

The data-parallel batch is the same global batch whatever the world size (split over the
ranks), so the resumed run continues the 4-rank run's loss curve: the demo compares them with
an uninterrupted 4-rank run.

Run with ``./dev demo`` (part 2), or ``python examples/train_fsdp.py [work_dir]``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

VOCAB, DIM, HEADS, LAYERS, SEQ, GLOBAL_BATCH = 101, 32, 4, 2, 16, 8
SAVE_AT, TOTAL_STEPS = 4, 8


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.out = torch.nn.Linear(DIM, DIM)
        self.norm2 = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, DIM // HEADS).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, t, DIM))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def global_batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)


def build(world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyTransformer()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        ids = global_batch(step).chunk(world)[rank]  # this rank's part of the global batch
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def worker(rank: int, world: int, port: int, phase: str, work: str, queue) -> None:
    from distckpt.checkpoint import load_model_and_optim_state, save_model_and_optim_state

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        ckpt = os.path.join(work, f"step{SAVE_AT}")
        model, optim = build(world)
        if phase == "train":
            losses = train(model, optim, range(SAVE_AT))
            save_model_and_optim_state(ckpt, model, optim)
            losses += train(model, optim, range(SAVE_AT, TOTAL_STEPS))  # the uninterrupted run
        else:
            load_model_and_optim_state(ckpt, model, optim)
            losses = train(model, optim, range(SAVE_AT, TOTAL_STEPS))
            with torch.no_grad():
                logits = model(global_batch(1000)[:, :-1])  # FSDP2 gathers the parameters
            save_model_and_optim_state(os.path.join(work, f"step{TOTAL_STEPS}"), model, optim)
            if rank == 0:
                torch.save(logits, os.path.join(work, "final_logits.pt"))
        if rank == 0:
            queue.put(losses)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, phase: str, work: str) -> list[float]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(world, free_port(), phase, work, queue), nprocs=world, start_method="spawn")
    return queue.get()


def main(work: str | None = None) -> None:
    work = work or os.path.join(tempfile.gettempdir(), "distckpt-train-demo")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    start = time.perf_counter()
    print(f"a) FSDP2 on 4 processes: train {TOTAL_STEPS} steps, checkpoint after step {SAVE_AT}")
    reference = launch(4, "train", work)
    print("   loss " + " ".join(f"{x:.4f}" for x in reference))
    print(f"b) FSDP2 on 2 processes: resume from step{SAVE_AT}, train steps {SAVE_AT}..{TOTAL_STEPS - 1}")
    resumed = launch(2, "resume", work)
    print("   loss " + " " * (7 * SAVE_AT) + " ".join(f"{x:.4f}" for x in resumed))
    gap = max(abs(a - b) for a, b in zip(reference[SAVE_AT:], resumed))
    assert gap < 1e-4, f"the resumed run drifted from the uninterrupted one by {gap}"
    print(f"   the uninterrupted 4-process run's curve (max difference {gap:.1e}; the global batch is "
          "split 4 ways there and 2 ways here)")
    final = os.path.join(work, f"step{TOTAL_STEPS}")
    export = os.path.join(work, "export")
    print(f"c) distckpt unshard {final} {export} --safetensors")
    subprocess.run([sys.executable, "-m", "distckpt.cli", "unshard", final, export, "--safetensors"], check=True)

    from safetensors.torch import load_file

    weights = load_file(os.path.join(export, "model.safetensors"))
    plain = TinyTransformer()
    plain.load_state_dict(weights)  # strict: every parameter present, shapes right
    with torch.no_grad():
        logits = plain(global_batch(1000)[:, :-1])
    expected = torch.load(os.path.join(work, "final_logits.pt"), weights_only=True)
    assert torch.allclose(logits, expected, atol=1e-5), "the exported model computes something else"
    print(f"   loaded {len(weights)} tensors with safetensors into a plain nn.Module: same outputs "
          f"as the 2-process FSDP2 model (max difference {(logits - expected).abs().max().item():.1e})")
    print(f"training demo OK in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
