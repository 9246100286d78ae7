"""The causal LM's output head runs only at the positions the multiple-choice likelihood reads
(``logits_to_keep``), and that equals the full head at those positions, for every family's draws."""

from __future__ import annotations

import pytest
import torch

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRAXS, MultipleChoice
from pyrobayes.models import likelihoods as likelihoods_module
from pyrobayes.models.deploy import merged_network
from pyrobayes.models.multiple_choice import encode_multiple_choice, head_positions_supported
from pyrobayes.models.sharing import unshared
from tests import families
from tests.common import tiny_llama
from tests.models.test_multiple_choice import (
    CASES,
    CHOICES,
    NETS,
    PROMPTS,
    TARGETS,
    CharTokenizer,
    causal_lm_problem,
)


def _head_inputs(net):
    """Record the shape of every input the LM head sees."""
    shapes: list[tuple[int, ...]] = []
    head = net.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    return shapes, handle


def _full_head(monkeypatch):
    """Make the likelihood believe the network cannot restrict its head (the full computation)."""
    monkeypatch.setattr(likelihoods_module, "head_positions_supported", lambda net: False)


@pytest.mark.parametrize("arch", sorted(NETS))
def test_installed_transformers_gathers_per_row(arch):
    assert head_positions_supported(NETS[arch]())


@pytest.mark.parametrize("arch", sorted(NETS))
@pytest.mark.parametrize("side", ["left", "right"])
def test_single_token_choices_read_one_position(arch, side, monkeypatch):
    torch.manual_seed(0)
    net = NETS[arch]().eval()
    model = FineTuneModel(
        net,
        LoRAXS(rank=2, target_modules=TARGETS[arch]),
        likelihood="multiple_choice",
        choice_token_ids=[5, 6, 7],
        trainable_modules=[],
    )
    ids = torch.randint(3, 99, (4, 7))
    mask = torch.ones(4, 7, dtype=torch.long)
    if side == "left":
        mask[1, :3] = 0
    else:
        mask[1, 4:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    values = {s: torch.randn(3, *v.shape) for s, v in model.init_values().items()}
    shapes, handle = _head_inputs(net)
    with torch.no_grad():
        gathered = model.batched_output(batch, values)
    handle.remove()
    assert shapes == [(12, 1, 32)]  # S·B rows, one position each
    _full_head(monkeypatch)
    with torch.no_grad():
        full = model.batched_output(batch, values)
        first = {s: v[0] for s, v in values.items()}
        plain = merged_network(model, first)(**batch).logits  # every position
    torch.testing.assert_close(gathered, full, rtol=0, atol=1e-6)
    last = 3 if side == "right" else 6  # the answer position: the last real token
    torch.testing.assert_close(gathered[0, 1], plain[1, last, [5, 6, 7]], rtol=0, atol=1e-6)


# a one-step fit: SWAG collects one iterate (no spread), enough for this plumbing check
@pytest.mark.filterwarnings("ignore::pyrobayes.guides.lowrank.DegenerateSWAGWarning")
@pytest.mark.parametrize(("family", "adapter_name", "arch"), CASES)
def test_gathered_head_equals_full_head_for_every_family(family, adapter_name, arch, monkeypatch):
    model, batch = causal_lm_problem(
        family,
        arch,
        adapter_name,
        likelihood=MultipleChoice(normalize="length"),
        padding_side="right",
    )
    net = model.net
    hidden = net.config.hidden_size if hasattr(net.config, "hidden_size") else net.config.n_embd
    guide = families.posterior(model, family)
    pb.fit(model, guide, [batch], epochs=1, lr=1e-2)  # post-hoc families need their fit
    values = guide.sample_posterior(3, generator=torch.Generator().manual_seed(0))
    model.train(False)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    shapes, handle = _head_inputs(net)
    # the plain K-row path (shared prompts score fewer rows: tests/models/test_prefix_sharing.py)
    with torch.no_grad(), unshared():
        gathered = model.batched_output(inputs, values)
    handle.remove()
    rows = next(iter(values.values())).shape[0] * 3 * 5
    longest = int(batch["continuation_mask"].sum(-1).max())
    # the head saw S·B·K rows at the longest continuation's positions, not every position
    assert shapes == [(rows, longest, hidden)]
    assert longest < batch["input_ids"].shape[-1]
    _full_head(monkeypatch)
    shapes, handle = _head_inputs(net)
    with torch.no_grad():
        full = model.batched_output(inputs, values)
    handle.remove()
    assert shapes == [(rows, batch["input_ids"].shape[-1], hidden)]
    torch.testing.assert_close(gathered, full, rtol=0, atol=1e-6)


def test_training_objective_is_the_same_with_the_gathered_head(monkeypatch):
    # the fitters' objectives and the Pyro program run through the same gathered forward
    torch.manual_seed(0)
    model = FineTuneModel(
        tiny_llama().eval(),
        LoRAXS(rank=2, target_modules=["q_proj"]),
        likelihood="multiple_choice",
        trainable_modules=[],
        num_data=3,
    )
    batch = encode_multiple_choice(CharTokenizer(), PROMPTS, CHOICES, answers=[0, 1, 2])
    values = {
        s: torch.randn(2, *v.shape, requires_grad=True) for s, v in model.init_values().items()
    }

    def nll_and_grad():
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        nll = -model.log_likelihood(model.batched_output(inputs, values), batch["labels"]).sum()
        grads = torch.autograd.grad(nll, list(values.values()))
        return nll.detach(), grads

    nll, grads = nll_and_grad()
    _full_head(monkeypatch)
    nll_full, grads_full = nll_and_grad()
    torch.testing.assert_close(nll, nll_full, rtol=0, atol=1e-6)
    for g, g_full in zip(grads, grads_full, strict=True):
        torch.testing.assert_close(g, g_full, rtol=0, atol=1e-6)
