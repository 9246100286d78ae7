"""Seeding inside a forked RNG without touching the generators the fork does not restore."""

from __future__ import annotations

import torch

__all__ = ["seed_forked"]


def seed_forked(seed: int, device: torch.device | None = None) -> None:
    """Seed the CPU generator, and ``device``'s generator when it is a CUDA device, only.

    Meant inside ``torch.random.fork_rng(devices=[device])`` (or ``devices=[]`` for the CPU
    alone), which restores exactly those generators on exit. ``torch.manual_seed`` there would
    also reseed every other GPU's generator (``torch.cuda.manual_seed_all``), which the fork
    does not restore: a fit's draws on the GPU would then follow that seed instead of the fit's.
    """
    torch.default_generator.manual_seed(seed)
    if device is not None and device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
