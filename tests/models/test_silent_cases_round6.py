"""Silent cases in the LoRA-XS projections, the permutation spec and ``batched_output``:
bad input that gave NaN factors, a confusing error, a plain-SVD fallback or a claimed but
absent symmetry now gives a clear error or warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor, nn

from pyrobayes.models import FineTuneModel, LoRAXS, PermutationSpec
from pyrobayes.models.projections import (
    PROJECTIONS,
    InputMoments,
    collect_input_moments,
    project,
    svd_projection,
    wsvd_projection,
)


def _values(model: FineTuneModel) -> dict[str, Tensor]:
    """The model's latent sites at the values its network holds (one draw, no sample axis)."""
    return {
        s: model.net.get_parameter(spec.param_name).detach().clone()
        for s, spec in model.latent_sites.items()
    }


# ------------------------------------------------------------------ projections


@pytest.mark.parametrize("method", PROJECTIONS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_base_weight_is_refused_by_every_projection(method: str, bad: float) -> None:
    w = torch.randn(6, 4)
    w[2, 1] = bad
    # before: svd / wsvd raised torch's LinAlgError, dct / random returned NaN factors
    with pytest.raises(ValueError, match="non-finite"):
        project(w, 2, method, covariance=torch.eye(6), generator=torch.Generator())


def test_lora_xs_on_a_layer_with_an_overflowed_float16_weight_names_the_cause() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with torch.no_grad():
        net[0].weight[0, 0] = 1e6  # overflows to inf in float16
    net[0].half()
    with pytest.raises(ValueError, match=r"non-finite.*float16"):
        FineTuneModel(net, adapter=LoRAXS(rank=2, target_modules=["0"], projection="dct"))


def test_a_generator_that_is_not_a_torch_generator_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"generator must be a torch\.Generator.*manual_seed"):
        project(torch.randn(6, 4), 2, "random", generator=3)  # type: ignore[arg-type]


def test_nan_calibration_inputs_are_refused_naming_the_module() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"collect_input_moments.*\['0', '2'\].*NaN or inf"):
        collect_input_moments(net, ["0", "2"], [x], forward=lambda m, b: m(b))


def test_lora_xs_wsvd_with_nan_calibration_data_names_the_layers() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 4)
    x[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"module\(s\) \['0'\] held NaN or inf"):
        FineTuneModel(
            net,
            adapter=LoRAXS(rank=2, target_modules=["0"], projection="wsvd"),
            calibration_data=[(x, torch.zeros(5, dtype=torch.long))],
        )


def test_a_covariance_with_negative_eigenvalues_is_refused() -> None:
    w = torch.randn(6, 4, dtype=torch.float64)
    cov = torch.diag(torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0, -0.5], dtype=torch.float64))
    # before: the negative eigenvalue was clamped to 1e-10 without a word
    with pytest.raises(ValueError, match="not positive semi-definite"):
        wsvd_projection(w, 2, cov)


def test_an_asymmetric_covariance_is_refused() -> None:
    w = torch.randn(6, 4, dtype=torch.float64)
    cov = torch.eye(6, dtype=torch.float64)
    cov[0, 1] = 0.5  # the symmetric part is a valid covariance: it used to be taken silently
    with pytest.raises(ValueError, match="not symmetric"):
        wsvd_projection(w, 2, cov)


def test_a_rank_deficient_float32_covariance_is_still_accepted() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=g)  # 3 rows in 8 dims: rank 2 after centring
    moments = InputMoments().update(x)
    cov32 = moments.covariance().float()
    a, b = wsvd_projection(torch.randn(8, 5, generator=g), 2, cov32)
    assert a.shape == (8, 2) and b.shape == (2, 5)
    assert bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())


def test_a_zero_input_covariance_warns_that_wsvd_is_the_plain_svd() -> None:
    w = torch.randn(6, 4, dtype=torch.float64)
    moments = InputMoments().update(torch.ones(10, 6))  # inputs that never vary
    with pytest.warns(UserWarning, match=r"covariance of this layer is zero.*plain SVD"):
        a, b = project(w, 2, "wsvd", covariance=moments)
    a_svd, b_svd = svd_projection(w, 2)
    torch.testing.assert_close(a @ b, a_svd @ b_svd)


def test_lora_xs_wsvd_on_constant_calibration_inputs_warns() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.ones(5, 4)
    with pytest.warns(UserWarning, match="calibration inputs do not vary"):
        FineTuneModel(
            net,
            adapter=LoRAXS(rank=2, target_modules=["0"], projection="wsvd"),
            calibration_data=[(x, torch.zeros(5, dtype=torch.long))],
        )


# ------------------------------------------------------------------ permutation symmetry


class _ResidualSequential(nn.Sequential):
    """An ``nn.Sequential`` whose square linear layers add their input (residual blocks)."""

    def forward(self, x: Tensor) -> Tensor:
        for module in self:
            square = isinstance(module, nn.Linear) and module.in_features == module.out_features
            x = x + module(x) if square else module(x)
        return x


def test_a_sequential_subclass_with_its_own_forward_is_not_claimed_a_symmetry() -> None:
    torch.manual_seed(0)
    inner = _ResidualSequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    net = nn.Sequential(nn.Linear(4, 6), inner, nn.Linear(6, 3))
    model = FineTuneModel(net, latent_modules=["1.0", "1.2"])
    values = _values(model)
    # the residual connection makes unit permutations change the function
    moved = dict(values)
    perm = torch.tensor([1, 0, 2, 3, 4, 5])
    moved["1.0.weight"] = values["1.0.weight"][perm]
    moved["1.0.bias"] = values["1.0.bias"][perm]
    moved["1.2.weight"] = values["1.2.weight"][:, perm]
    x = torch.randn(5, 4)
    with torch.no_grad():
        assert float((model.output(x, moved) - model.output(x, values)).abs().max()) > 1e-3
    # before: from_model returned a spec over these units
    with (
        pytest.warns(UserWarning, match=r"'1' is a _ResidualSequential.*left out"),
        pytest.raises(ValueError, match="no permutation symmetry"),
    ):
        PermutationSpec.from_model(model)


def test_a_hook_on_the_hidden_units_leaves_them_out_of_the_group() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    shift = torch.arange(6.0)
    net[3].register_forward_hook(lambda module, args, out: out + shift)  # per-unit offsets
    model = FineTuneModel(net, latent_modules=["0", "2", "4"])
    with pytest.warns(UserWarning, match=r"'2' has its hidden units seen by a hook on '3'"):
        spec = PermutationSpec.from_model(model)
    assert [u.name for u in spec.layers] == ["0"]  # before: ["0", "2"]
    x = torch.randn(5, 4)
    assert spec.check_function(model, x, _values(model)) <= 1e-5


def test_a_plain_mlp_still_has_both_hidden_layers_without_a_warning() -> None:
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 3))
    model = FineTuneModel(net, latent_modules=["0", "2", "4"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        spec = PermutationSpec.from_model(model)
    assert [u.name for u in spec.layers] == ["0", "2"]


# ------------------------------------------------------------------ batched_output


def _head_model() -> FineTuneModel:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    return FineTuneModel(net, latent_modules=["2"])


def test_batched_output_refuses_one_draw_without_its_sample_axis() -> None:
    model = _head_model()
    x = torch.randn(5, 4)
    one = {"2.weight": torch.randn(3, 6), "2.bias": torch.randn(3)}
    # before: read as 3 draws along the weight's rows, output (3, 5, 3)
    with pytest.raises(ValueError, match=r"values\['2.(weight|bias)'\] has shape .*unsqueeze"):
        model.batched_output(x, one)
    out = model.batched_output(x, {s: v.unsqueeze(0) for s, v in one.items()})
    assert out.shape == (1, 5, 3)


def test_batched_output_refuses_a_missing_site() -> None:
    model = _head_model()
    # before: the bias slot's own value ran in place of a draw
    with pytest.raises(ValueError, match=r"\['2.bias'\] are missing"):
        model.batched_output(torch.randn(5, 4), {"2.weight": torch.randn(2, 3, 6)})


def test_batched_output_refuses_an_unknown_site_naming_it() -> None:
    model = _head_model()
    values = {"2.weight": torch.randn(2, 3, 6), "2.bias": torch.randn(2, 3)}
    values["2.wieght"] = torch.randn(2, 3, 6)
    # before: KeyError('2.wieght')
    with pytest.raises(ValueError, match=r"\['2.wieght'\] are not latent sites"):
        model.batched_output(torch.randn(5, 4), values)


def test_batched_output_refuses_a_transposed_site_value() -> None:
    model = _head_model()
    values = {"2.weight": torch.randn(2, 6, 3), "2.bias": torch.randn(2, 3)}
    with pytest.raises(ValueError, match=r"values\['2.weight'\] has shape \(2, 6, 3\)"):
        model.batched_output(torch.randn(5, 4), values)
