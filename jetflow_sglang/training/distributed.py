"""Data-parallel training under torchrun: process group setup and a check that ranks agree."""

from __future__ import annotations

import os

import torch


def setup() -> tuple[int, int, torch.device]:
    """(rank, world size, device); starts the process group under torchrun."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), world, device


@torch.no_grad()
def rank_fingerprints(module: torch.nn.Module) -> list[list[float]]:
    """Every rank's (sum, sum of squares, position-weighted sum) of its parameters, gathered on
    all ranks: DistributedDataParallel keeps them equal; a rank that trained alone would not."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().double().flatten().cpu() for p in module.parameters()])
    weights = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64)
    mine = torch.stack([flat.sum(), (flat * flat).sum(), (flat * weights).sum()])
    if not dist.is_initialized():
        return [mine.tolist()]
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [g.tolist() for g in gathered]
