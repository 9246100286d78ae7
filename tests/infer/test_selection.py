"""pb.fit(val_data=...): the best validated epoch is restored (SPECS 2(b) TRAIN_MAP)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.infer import grouped
from tests.common import conjugate_core, mlp, mlp_problem, split_batches


def _run(family: str, epochs: int, val: str | None, select_by: str = "nll", **kw):
    torch.manual_seed(0)
    prob = conjugate_core()
    train = split_batches(prob.x, prob.y)
    if val == "train":  # the fit improves it every epoch: the last epoch is the best
        val_data = split_batches(prob.x, prob.y)  # a copy: fit warns on the training object
    elif val == "flipped":  # targets of the opposite sign: the fit worsens it every epoch
        val_data = split_batches(prob.x, 2 * prob.model.net[0].base(prob.x).detach() - prob.y)
    else:
        val_data = None
    guide = pb.posterior(prob.model, family)
    result = pb.fit(
        prob.model,
        guide,
        train,
        epochs=epochs,
        seed=0,
        lr=0.05,
        **grouped(val_data=val_data, select_by=select_by, **kw),
    )
    return guide, result


def _state(guide) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in guide.state_dict().items()}


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("family", ["map", "meanfield", "ivon"])
def test_worsening_validation_restores_the_first_epoch(family):
    # a constant rate: IVON's default cosine over 4 epochs is not the 1-epoch run's below
    kw = {"scheduler": "constant"} if "ivon" in family else {}
    guide, result = _run(family, epochs=4, val="flipped", **kw)
    history = result.state["validation"]
    assert [h["epoch"] for h in history] == [0, 1, 2, 3]
    nll = [h["nll"] for h in history]
    assert nll == sorted(nll) and nll[0] < nll[-1], nll  # validation got worse every epoch
    assert result.state["best_epoch"] == 0
    # the restored state is the state after one epoch of the same run (validation draws no
    # random numbers, so the trajectory is the one without val_data)
    one_epoch, _ = _run(family, epochs=1, val=None, **kw)
    _assert_same_state(_state(guide), _state(one_epoch))
    assert len(result.losses) == 4 * 4  # training itself ran all four epochs


def test_improving_validation_keeps_the_last_epoch():
    guide, result = _run("map", epochs=3, val="train", select_by="rmse")
    rmse = [h["rmse"] for h in result.state["validation"]]
    assert rmse == sorted(rmse, reverse=True) and rmse[-1] < rmse[0], rmse
    assert result.state["best_epoch"] == 2
    plain, _ = _run("map", epochs=3, val=None)
    _assert_same_state(_state(guide), _state(plain))


def test_laplace_fits_its_curvature_at_the_selected_map():
    lap, result = _run("laplace", epochs=3, val="flipped")
    assert result.state["best_epoch"] == 0 and lap.is_fitted
    ref, _ = _run("laplace", epochs=1, val=None)
    for site in lap.sites:
        torch.testing.assert_close(lap.loc(site), ref.loc(site), rtol=0, atol=0)
        torch.testing.assert_close(lap.posterior_precision(site), ref.posterior_precision(site))


def test_selection_survives_resume(tmp_path):
    full, full_result = _run("map", epochs=4, val="flipped")
    _run("map", epochs=2, val="flipped", checkpoint_dir=tmp_path)
    resumed, resumed_result = _run(
        "map", epochs=4, val="flipped", checkpoint_dir=tmp_path, resume=True
    )
    assert resumed_result.state["best_epoch"] == full_result.state["best_epoch"] == 0
    assert [h["nll"] for h in resumed_result.state["validation"]] == pytest.approx(
        [h["nll"] for h in full_result.state["validation"]], rel=1e-10
    )
    _assert_same_state(_state(resumed), _state(full))


def test_point_parameters_are_restored_too():
    prob = mlp_problem(
        (4, 8, 3),
        pb.models.LoRAXS(rank=2, target_modules=["0"]),
        num_data=48,
        seed=0,
        activation=nn.ReLU,
        trainable_modules=["2"],
    )
    model, net, x, y = prob.model, prob.model.net, prob.x, prob.y
    train = split_batches(x, y)
    val = split_batches(x, (y + 1) % 3)  # other labels: fitting the train labels hurts these
    head_before = net[2].weight.detach().clone()
    guide = pb.posterior(model, "map")
    result = pb.fit(
        model,
        guide,
        train,
        epochs=5,
        lr=0.05,
        seed=0,
        validation=pb.Validation(val, select_by="accuracy"),
    )
    best = result.state["best_epoch"]
    accuracies = [h["accuracy"] for h in result.state["validation"]]
    assert accuracies[best] == max(accuracies)
    torch.manual_seed(0)
    net2 = mlp(4, 8, 3, activation=nn.ReLU)
    model2 = pb.models.FineTuneModel(
        net2, pb.models.LoRAXS(rank=2, target_modules=["0"]), num_data=48, trainable_modules=["2"]
    )
    pb.fit(model2, pb.posterior(model2, "map"), train, epochs=best + 1, lr=0.05, seed=0)
    assert not torch.equal(net2[2].weight, head_before)  # the head did train
    torch.testing.assert_close(net[2].weight, net2[2].weight, rtol=0, atol=0)


def test_bad_select_by_is_named():
    torch.manual_seed(0)
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "map")
    data = split_batches(prob.x, prob.y)
    with pytest.raises(ValueError, match="select_by"):
        pb.Validation(data, select_by="f1")
    before = {k: v.clone() for k, v in guide.state_dict().items()}
    with pytest.raises(ValueError, match="classification"):
        pb.fit(
            prob.model,
            guide,
            data,
            epochs=1,
            validation=pb.Validation(data[:1], select_by="accuracy"),
        )
    # refused before the first epoch (it was refused at the first validation, an epoch on)
    assert all(torch.equal(v, guide.state_dict()[k]) for k, v in before.items())


def test_best_state_survives_a_mid_epoch_interrupt(tmp_path):
    # step checkpoints carry the best snapshot too: interrupted in epoch 2 (best = epoch 0)
    full, full_result = _run("map", epochs=4, val="flipped")

    def interrupt(step: int, loss: float) -> None:
        if step == 10:  # 4 steps per epoch: the checkpoint of step 10 is mid-epoch 2
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(
            "map",
            epochs=4,
            val="flipped",
            checkpoint_dir=tmp_path,
            checkpoint_every=1,
            callback=interrupt,
        )
    resumed, result = _run("map", epochs=4, val="flipped", checkpoint_dir=tmp_path, resume=True)
    assert result.state["best_epoch"] == full_result.state["best_epoch"] == 0
    _assert_same_state(_state(resumed), _state(full))


@pytest.mark.parametrize("patience", [1, 2])
def test_patience_stops_after_that_many_epochs_without_improvement(patience):
    # flipped targets worsen the validation NLL every epoch: the best is epoch 0, and the fit
    # stops after epoch `patience` (the `patience` epochs that followed it did not improve)
    guide, result = _run("map", epochs=10, val="flipped", patience=patience)
    assert [h["epoch"] for h in result.state["validation"]] == list(range(patience + 1))
    assert result.state["best_epoch"] == 0 and result.state["stopped_early"] is True
    assert result.state["epoch"] == patience + 1
    assert len(result.losses) == 4 * (patience + 1)  # four batches an epoch
    one_epoch, _ = _run("map", epochs=1, val=None)
    _assert_same_state(_state(guide), _state(one_epoch))


def test_patience_never_stops_a_fit_that_keeps_improving():
    guide, result = _run("map", epochs=3, val="train", patience=1)
    assert result.state["best_epoch"] == 2 and result.state["stopped_early"] is False
    assert result.state["epoch"] == 3
    plain, _ = _run("map", epochs=3, val=None)
    _assert_same_state(_state(guide), _state(plain))


def test_patience_survives_resume(tmp_path):
    # killed after epoch 1 of a run that stops after epoch 2 (patience 2): the resumed run
    # stops at the same epoch, with the same state
    full, full_result = _run("map", epochs=10, val="flipped", patience=2)
    _run("map", epochs=2, val="flipped", patience=2, checkpoint_dir=tmp_path)
    resumed, resumed_result = _run(
        "map", epochs=10, val="flipped", patience=2, checkpoint_dir=tmp_path, resume=True
    )
    assert resumed_result.state["epoch"] == full_result.state["epoch"] == 3
    assert resumed_result.state["stopped_early"] is True
    _assert_same_state(_state(resumed), _state(full))
    # resuming a run that already stopped early trains no further
    again, again_result = _run(
        "map", epochs=10, val="flipped", patience=2, checkpoint_dir=tmp_path, resume=True
    )
    assert again_result.state["epoch"] == 3 and len(again_result.losses) == 12
    _assert_same_state(_state(again), _state(full))


def test_bad_patience_is_named():
    torch.manual_seed(0)
    prob = conjugate_core()
    guide = pb.posterior(prob.model, "map")
    data = split_batches(prob.x, prob.y)
    with pytest.raises(ValueError, match=r"patience=2 needs val_data"):
        pb.fit(prob.model, guide, data, epochs=1, patience=2)
    with pytest.raises(ValueError, match="patience"):
        pb.Validation(data, patience=0)
    with pytest.raises(TypeError, match="patience"):
        pb.Validation(data, patience=1.5)


def test_validating_on_the_training_data_is_warned():
    # the same object, or a second loader over the same dataset, makes "the best epoch" the
    # training fit's; a held-out loader over another dataset passes without a word
    torch.manual_seed(0)
    prob = conjugate_core()
    train_set = torch.utils.data.TensorDataset(prob.x, prob.y)
    loader = torch.utils.data.DataLoader(train_set, batch_size=8)
    again = torch.utils.data.DataLoader(train_set, batch_size=16)
    held_out = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(prob.x[:8], prob.y[:8]), batch_size=8
    )
    for val in (loader, again):
        guide = pb.posterior(prob.model, "map")
        with pytest.warns(UserWarning, match="validation data are the training data"):
            pb.fit(prob.model, guide, loader, epochs=1, validation=pb.Validation(val))
    guide = pb.posterior(prob.model, "map")
    pb.fit(prob.model, guide, loader, epochs=1, validation=pb.Validation(held_out))
