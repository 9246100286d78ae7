"""pb.fit: steps/epochs, seeding, checkpoints, resume, and failure without loss of state."""

from __future__ import annotations

import pyro
import pytest
import torch

import pyrobayes as pb
from pyrobayes.infer.checkpoint import latest
from tests.common import conjugate_core, split_batches


def test_epochs_and_steps_and_seed():
    torch.manual_seed(0)  # the cores' N(0, 1e-5²) init draws from the global RNG
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    g1 = pb.guides.MeanFieldGuide(prob.model)
    r1 = pb.fit(prob.model, g1, data, epochs=2, seed=3)
    assert len(r1.losses) == 2 * len(data) and r1.state["epoch"] == 2
    torch.manual_seed(0)
    prob2 = conjugate_core()
    g2 = pb.guides.MeanFieldGuide(prob2.model)
    r2 = pb.fit(prob2.model, g2, data, epochs=2, seed=3)
    assert torch.equal(r1.losses, r2.losses)  # same seed, same trajectory
    r3 = pb.fit(prob.model, g1, data, num_steps=3)
    assert len(r3.losses) == 3
    with pytest.raises(ValueError, match="epochs"):
        pb.fit(prob.model, g1, data)


@pytest.mark.parametrize("family", ["meanfield", "map", "ivon", "kron-ivon", "swag"])
def test_resume_continues_where_it_stopped(tmp_path, family):
    kw = {"T_inv": 3} if family == "kron-ivon" else {}  # a re-decomposition between the halves
    lr = 0.05 if "ivon" in family else 1e-2
    torch.manual_seed(0)
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    full = pb.fit(prob.model, pb.posterior(prob.model, family, **kw), data, epochs=4, seed=0, lr=lr)
    torch.manual_seed(0)
    prob_b = conjugate_core()
    guide_b = pb.posterior(prob_b.model, family, **kw)
    pb.fit(prob_b.model, guide_b, data, epochs=2, seed=0, checkpoint_dir=tmp_path, lr=lr)
    torch.manual_seed(0)
    prob_c = conjugate_core()
    guide_c = pb.posterior(prob_c.model, family, **kw)
    resumed = pb.fit(
        prob_c.model,
        guide_c,
        data,
        epochs=4,
        seed=123,
        checkpoint_dir=tmp_path,
        resume=True,
        lr=lr,
    )
    # guide state, optimizer moments and RNG state restored: the same trajectory to round-off
    torch.testing.assert_close(resumed.losses, full.losses, rtol=1e-10, atol=1e-8)


def test_non_finite_loss_stops_before_update_and_keeps_checkpoint(tmp_path):
    prob = conjugate_core()
    data = split_batches(prob.x, prob.y)
    guide = pb.guides.MeanFieldGuide(prob.model)
    pb.fit(prob.model, guide, data, epochs=1, checkpoint_dir=tmp_path)
    saved = pb.io.read_header(latest(tmp_path) / "posterior.safetensors")
    assert saved["family"] == "meanfield"
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    # finite targets whose loss overflows, as a diverging run's (NaN data is refused earlier)
    bad = [(prob.x[:16], torch.full_like(prob.y[:16], 1e200))]
    pyro.enable_validation(False)
    with pytest.raises(FloatingPointError, match="step 0"):
        pb.fit(prob.model, guide, bad, num_steps=1, checkpoint_dir=tmp_path, overwrite=True)
    for k, v in guide.state_dict().items():
        assert torch.equal(v, before[k]), k  # parameters untouched
    restored = pb.load(latest(tmp_path) / "posterior.safetensors", prob.model)
    for k, v in restored.state_dict().items():
        assert torch.equal(v, before[k]), k  # the checkpoint is the last good state


def test_empty_data_is_an_error():
    prob = conjugate_core()
    with pytest.raises(ValueError, match="no batches"):
        pb.fit(prob.model, pb.guides.MeanFieldGuide(prob.model), [], num_steps=2)
