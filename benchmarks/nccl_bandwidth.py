#!/usr/bin/env python3
"""NCCL bandwidth between the GPUs of one host at the K2 drafter's gradient size (issue 16).

  torchrun --nproc_per_node 2 benchmarks/nccl_bandwidth.py --out OUT.json    (NCCL_DEBUG=INFO shows the transport)

For each collective (all_reduce, reduce_scatter, all_gather) over `--gib` GiB of bf16 (default 2.22 GiB: the
1.19 B trainable parameters of configs/drafters/kimi-k2.json), 2 untimed then `--reps` timed calls, CUDA events;
the median, and the bus bandwidth as nccl-tests defines it (all_reduce 2(n-1)/n, the others (n-1)/n of the size
per second). A ZeRO-2 step moves its gradients once (DeepSpeed reduces each bucket) and its parameters once (the
gather after the update): these two times are what data parallelism costs a step at best.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist


def timed(fn, reps: int) -> list[float]:
    for _ in range(2):
        fn()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.19e9 * 2 / 2**30)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    numel = int(a.gib * 2**30 / 2) // n * n
    x = torch.randn(numel, dtype=torch.bfloat16, device="cuda")
    shard = torch.empty(numel // n, dtype=torch.bfloat16, device="cuda")
    size = numel * 2
    cases = {
        "all_reduce": (lambda: dist.all_reduce(x), 2 * (n - 1) / n),
        "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, x), (n - 1) / n),
        "all_gather": (lambda: dist.all_gather_into_tensor(x, shard), (n - 1) / n),
    }
    rows = {}
    for name, (fn, factor) in cases.items():
        s = statistics.median(timed(fn, a.reps))
        rows[name] = {"ms": s * 1e3, "bus_GBps": size * factor / s / 1e9}
    if rank == 0:
        result = {"world": n, "bytes": size, "dtype": "bf16", "reps": a.reps, "collectives": rows}
        print(json.dumps(result, indent=1))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
