"""Silent cases of device batches and seeded draws: a ``choice_token_ids`` batch on a device
with an all-padding row (refused once, on the first device batch, as on the CPU), and
``sample_posterior(generator=...)``, which seeds only the generators it forks (the CPU's and the
guide's own CUDA device's), never every GPU's."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.guides.base import PosteriorGuide
from pyrobayes.models import LoRAXS, MultipleChoice
from tests.common import mlp_problem

# --------------------------------------------------------------------------------------------
# choice_token_ids: an all-padding row of a batch on a device


class _OnDevice(torch.Tensor):
    """CPU values that report a CUDA device, as a batch moved to a GPU reaches the likelihood
    (no GPU here); every read of a value on the host (a device synchronisation) is counted."""

    host_reads = 0

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)

    def __bool__(self) -> bool:
        _OnDevice.host_reads += 1
        return super().__bool__()

    def item(self) -> Any:
        _OnDevice.host_reads += 1
        return super().item()

    def tolist(self) -> Any:
        _OnDevice.host_reads += 1
        return super().tolist()


def _token_batch(mask: list[list[int]], on_device: bool) -> dict[str, torch.Tensor]:
    attention = torch.tensor(mask)
    if on_device:
        attention = attention.as_subclass(_OnDevice)
    return {"input_ids": torch.full(attention.shape, 5), "attention_mask": attention}


def _forward(likelihood: MultipleChoice, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The likelihood's part of a forward: the network's inputs, then the answer logits read
    from the head's output at the position read, ``(B, 1, V)`` (``logits_to_keep``)."""
    likelihood.network_inputs(batch, nn.Identity())
    return likelihood.params(torch.randn(batch["input_ids"].shape[0], 1, 11), batch)


@pytest.mark.parametrize("on_device", [False, True], ids=["cpu", "device"])
def test_choice_token_ids_all_padding_row_is_refused_on_any_device(on_device):
    """Without the check a device batch's all-padding row read its answer at its last
    position, a padding token, silently; the CPU refused it."""
    likelihood = MultipleChoice(choice_token_ids=[3, 7])
    batch = _token_batch([[1, 1, 0], [0, 0, 0], [0, 1, 1]], on_device)
    with pytest.raises(ValueError, match=r"attention_mask of examples \[1\] \(of 3\) is all zeros"):
        _forward(likelihood, batch)


def test_choice_token_ids_device_check_reads_the_host_once_not_per_step():
    """A device batch is read on the host once (the first batch that passes), not on every
    forward: three forwards of clean device batches make one synchronisation."""
    likelihood = MultipleChoice(choice_token_ids=[3, 7])
    _OnDevice.host_reads = 0
    for _ in range(3):
        out = _forward(likelihood, _token_batch([[1, 1, 0], [0, 1, 1]], on_device=True))
        assert out.shape == (2, 2)
    assert _OnDevice.host_reads == 1
    # a failed check is no check: the next device batch is checked again
    fresh = MultipleChoice(choice_token_ids=[3, 7])
    for _ in range(2):
        with pytest.raises(ValueError, match="is all zeros"):
            _forward(fresh, _token_batch([[0, 0, 0], [0, 1, 1]], on_device=True))


# --------------------------------------------------------------------------------------------
# sample_posterior(generator=...): the CPU's and the guide's own device's generators only


def _guide() -> PosteriorGuide:
    prob = mlp_problem((4, 6, 3), LoRAXS(rank=2, target_modules=["0"]), num_data=8, seed=0)
    return pb.posterior(prob.model, "meanfield")


def _old_sample_posterior(guide: PosteriorGuide, num: int, generator: torch.Generator) -> Any:
    """The draws of the implementation before this fix (torch.manual_seed on a forked CPU RNG)."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return guide.rsample(num)


def test_sample_posterior_generator_draws_are_unchanged_and_leave_the_global_rng():
    guide = _guide()
    state = torch.get_rng_state()
    new = guide.sample_posterior(5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(torch.get_rng_state(), state)
    old = _old_sample_posterior(guide, 5, torch.Generator().manual_seed(3))
    assert new.keys() == old.keys()
    for site in new:  # the same seed of the same CPU generator: the same values, bit for bit
        assert torch.equal(new[site], old[site])


class _Seeds:
    """Stand-ins for ``torch.cuda``'s seeding and device selection, recording their calls."""

    def __init__(self) -> None:
        self.current: int | None = None
        self.seeded: list[tuple[int, int | None]] = []
        self.seeded_all: list[int] = []

    @contextlib.contextmanager
    def device(self, device: Any) -> Any:
        previous, self.current = self.current, torch.device(device).index
        try:
            yield
        finally:
            self.current = previous

    def manual_seed(self, seed: int) -> None:
        self.seeded.append((int(seed), self.current))

    def manual_seed_all(self, seed: int) -> None:
        self.seeded_all.append(int(seed))


def _patch_cuda(monkeypatch: pytest.MonkeyPatch) -> _Seeds:
    seeds = _Seeds()
    monkeypatch.setattr(torch.cuda, "manual_seed", seeds.manual_seed)
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeds.manual_seed_all)
    monkeypatch.setattr(torch.cuda, "device", seeds.device)
    return seeds


def test_sample_posterior_generator_reseeds_no_gpu_for_a_cpu_guide(monkeypatch):
    """``torch.manual_seed`` reseeded every GPU (``cuda.manual_seed_all``, queued until CUDA
    starts without one), whose generators the CPU guide's fork does not restore."""
    guide = _guide()
    seeds = _patch_cuda(monkeypatch)
    guide.sample_posterior(3, generator=torch.Generator().manual_seed(0))
    assert seeds.seeded_all == [] and seeds.seeded == []


def test_sample_posterior_generator_seeds_only_a_cuda_guides_own_device(monkeypatch):
    """A guide on ``cuda:1`` (its device reported; the values stay on the CPU here): its
    device's generator is forked and seeded, no other GPU's is touched."""
    guide = _guide()
    seed = int(torch.randint(0, 2**62, (1,), generator=torch.Generator().manual_seed(4)))
    expected = guide.sample_posterior(3, generator=torch.Generator().manual_seed(4))
    seeds = _patch_cuda(monkeypatch)
    forked: list[Any] = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: forked.append(device) or 0)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: forked.append(device))
    monkeypatch.setattr(type(guide), "device", property(lambda self: torch.device("cuda", 1)))
    draws = guide.sample_posterior(3, generator=torch.Generator().manual_seed(4))
    assert seeds.seeded_all == []
    assert seeds.seeded == [(seed, 1)]  # this device's generator, under cuda.device(1)
    assert forked == [torch.device("cuda", 1)] * 2  # its state saved and restored
    for site in draws:  # the CPU draws are those of the CPU guide
        assert torch.equal(draws[site], expected[site])
