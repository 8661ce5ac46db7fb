"""The collectives the trainer calls, single-process no-ops: the rank and world size, and the sums across ranks of
gradients and of reported floats (`eagle3q.draft.distributed` starts the ranks; `training` only calls these)."""

from __future__ import annotations

import torch


def rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    return rank_and_world()[0] == 0


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    import torch.distributed as dist

    if rank_and_world()[1] == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)


def all_reduce_floats(values: list[float]) -> list[float]:
    import torch.distributed as dist

    if rank_and_world()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return t.cpu().tolist()
