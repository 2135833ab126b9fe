#!/usr/bin/env python3
"""PyTorch DistributedDataParallel reference for `graphrun bench --backward --gpus N`.

The gpt_block of ../shared/bench/torch_reference.py (the same module, imported from
there), one process per GPU under torchrun, each with the full per-GPU batch (8 x 1024
tokens by default), SGD lr 0.01 and MSE loss as the reference's `train` pass. DDP with
its defaults (25 MiB gradient buckets, overlapped with backward). Eager mode: DDP's
overlap hooks are what it is known for; a whole-step CUDA graph of a DDP step is not
PyTorch's documented path.

    torchrun --standalone --nproc_per_node=N scripts/ddp_reference.py --json out.json

Rank 0 prints and writes the median step time (CUDA events around each step,
back-to-back steps) and samples per second over all GPUs.
"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

here = os.path.dirname(os.path.abspath(__file__))
for p in (os.environ.get("TORCH_REFERENCE_DIR", ""), here, os.path.join(here, "../../shared/bench")):
    if p and os.path.exists(os.path.join(p, "torch_reference.py")):
        sys.path.insert(0, p)
        break
from torch_reference import FULL_SHAPES, LR, GPTBlock  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16", choices=["f32", "tf32", "bf16"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    torch.backends.cuda.matmul.allow_tf32 = a.dtype == "tf32"
    torch.backends.cudnn.allow_tf32 = a.dtype == "tf32"
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    s = FULL_SHAPES["gpt_block"]
    torch.manual_seed(0)
    model = GPTBlock(s["d_model"], s["heads"], s["mlp_ratio"]).to(device="cuda", dtype=dt)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local])
    opt = torch.optim.SGD(ddp.parameters(), lr=LR, foreach=True)
    g = torch.Generator(device="cuda").manual_seed(1 + rank)
    x = torch.randn(s["batch"], s["seq"], s["d_model"], device="cuda", generator=g).to(dt)
    t = torch.randn(s["batch"], s["seq"], s["d_model"], device="cuda", generator=g).to(dt)

    def step():
        loss = F.mse_loss(ddp(x), t)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(a.iters)]
    for i in range(a.iters):
        starts[i].record()
        step()
        ends[i].record()
    torch.cuda.synchronize()
    ms = statistics.median(st.elapsed_time(e) for st, e in zip(starts, ends))
    # The slowest rank sets the pace.
    m = torch.tensor([ms], device="cuda")
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    ms = m.item()
    if rank == 0:
        samples = s["batch"] * world / (ms * 1e-3)
        row = dict(workload="gpt_block", dtype=a.dtype, mode="ddp", pass_="train", gpus=world,
                   batch_per_gpu=s["batch"], ms=ms, samples_per_s=samples,
                   torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())),
                   device=torch.cuda.get_device_name(0))
        print(f"DDP gpt_block {a.dtype} x{world}: median {ms:.3f} ms/step, {samples:.1f} samples/s")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"results": [row]}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
