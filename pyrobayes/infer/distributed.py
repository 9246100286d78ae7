"""``torch.distributed`` collectives shared by :func:`pyrobayes.fit` and the IVON fitters.

Every function is a no-op in a single process (or a world of size 1), so callers use them
unconditionally.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as torch_dist
from torch import Tensor

__all__ = [
    "world",
    "broadcast_",
    "all_reduce_mean_",
    "all_reduce_sum_",
    "all_reduce_grads_",
    "barrier",
    "staging_device",
]


def world() -> tuple[int, int]:
    """``(world_size, rank)`` under an initialised ``torch.distributed`` group, else ``(1, 0)``."""
    if torch_dist.is_available() and torch_dist.is_initialized():
        return torch_dist.get_world_size(), torch_dist.get_rank()
    return 1, 0


def staging_device(tensor: Tensor, backend: str) -> torch.device | None:
    """The device a collective of ``backend`` needs ``tensor`` on, when not its own: the
    current CUDA device for a CPU tensor under NCCL alone (which reduces CUDA tensors only;
    torch's "No backend type associated with device type cpu"), else ``None``. A group with a
    CPU backend beside NCCL (``"cpu:gloo,cuda:nccl"``) takes CPU tensors as they are."""
    if tensor.device.type != "cpu" or "nccl" not in backend or "gloo" in backend:
        return None
    return torch.device("cuda", torch.cuda.current_device())


def _collective_(tensor: Tensor, run: Callable[[Tensor], object]) -> None:
    """``run(tensor)``, an in-place collective, on the device the group's backend needs
    (:func:`staging_device`; a CPU count or metric sum under NCCL), written back in place."""
    stage = staging_device(tensor, str(torch_dist.get_backend()))
    if stage is None:
        run(tensor)
        return
    with torch.no_grad():
        staged = tensor.detach().to(stage)
        run(staged)
        tensor.copy_(staged)


def broadcast_(tensors: Sequence[Tensor]) -> None:
    """Copy rank 0's values into every rank in place (as DDP does when it wraps a module)."""
    if world()[0] == 1:
        return
    with torch.no_grad():
        for t in tensors:
            _collective_(t.data, lambda x: torch_dist.broadcast(x, src=0))


def all_reduce_mean_(tensors: Sequence[Tensor]) -> None:
    """Average ``tensors`` in place across processes."""
    size = world()[0]
    if size == 1:
        return
    for t in tensors:
        _collective_(t, lambda x: torch_dist.all_reduce(x, op=torch_dist.ReduceOp.SUM))
        t.div_(size)


def all_reduce_sum_(tensors: Sequence[Tensor]) -> None:
    """Sum ``tensors`` in place across processes."""
    if world()[0] == 1:
        return
    for t in tensors:
        _collective_(t, lambda x: torch_dist.all_reduce(x, op=torch_dist.ReduceOp.SUM))


def barrier() -> None:
    """Wait until every process reaches this point (e.g. rank 0's last checkpoint is written)."""
    if world()[0] > 1:
        torch_dist.barrier()


def all_reduce_grads_(params: Sequence[Tensor]) -> None:
    """Average ``.grad`` over ranks through one flat buffer per dtype/device (missing grad = 0)."""
    if world()[0] == 1:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        groups.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in groups.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce_mean_([flat])
        torch._foreach_copy_(
            grads,
            [
                v.view_as(g)
                for v, g in zip(flat.split([g.numel() for g in grads]), grads, strict=True)
            ],
        )
