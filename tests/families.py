"""What the registry-wide tests need to know about a family: one entry per family that needs one.

Every registered family runs through the registry-wide tests (the contract, the step API, the
Pyro-native checks, kill-and-resume, bad input) on the same small problems: an MLP with LoRA-XS
cores (:func:`tests.common.mlp_problem`) and the linear-Gaussian core
(:func:`tests.common.conjugate_core`). A family whose posterior needs another adapter (the LoRA
rank symmetry of a symmetrized guide), another network (σN norm layers) or its own options says so
here, and only here; the registry-wide tests then enrol it without a branch on its name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

import pyrobayes as pb

#: family -> ``pb.posterior`` options used by every registry-wide test.
OPTIONS: dict[str, dict[str, Any]] = {
    # the registry problems have C = 3 classes: the diversity term needs K <= C - 1 = 2
    "ibdr": {"num_particles": 2},
}

#: family -> the fit's settings (``optimizer=``) in the conformance kit's fits.
OPTIMIZERS: dict[str, Any] = {
    "kron-ivon": pb.infer.KronIVON(T_inv=3),  # a re-decomposition between the resumed halves
    "signorm": pb.infer.SigmaNormDiversity(strength=0.01),  # M = 2 from the model (ADAPTERS)
}

#: family -> extra options when the likelihood is Gaussian (the conjugate core).
#: (IBDR's diversity term, which needs class probabilities, defaults to 0 without them)
GAUSSIAN_OPTIONS: dict[str, dict[str, Any]] = {}

#: family -> adapter transform (e.g. LoRA-XS cores -> LoRA factors of the same rank and targets).
ADAPTERS: dict[str, Callable[[Any], Any]] = {
    # LoRA-XS cores sit between fixed bases (no permutation symmetry); LoRA's rank axis is one
    "symmetrized": lambda a: pb.models.LoRA(rank=a.rank, target_modules=a.target_modules),
    # σN: two members over the norm layer (NETS) on top of the same LoRA-XS cores
    "signorm": lambda a: pb.models.SigmaNorm(num_members=2, adapter=a),
}

#: family -> network transform applied before the ``FineTuneModel`` is built.
NETS: dict[str, Callable[[nn.Module], nn.Module]] = {
    # σN needs a norm layer: a LayerNorm appended after the last linear layer keeps the
    # nn.Sequential indices ("0", "2", ...) that target_modules / trainable_modules name
    "signorm": lambda net: net.append(nn.LayerNorm(_out_features(net))),
}

#: family -> why Pyro's SVI with Pyro's ELBOs is not expected to reach the conjugate core's exact
#: posterior mean (the family is not a Gaussian q over the core). Absent: it is expected to.
NOT_EXACT_UNDER_PYRO_SVI: dict[str, str] = {
    "symmetrized": "its model is LoRA factors (ADAPTERS): the update B·A is a product, not a "
    "linear-Gaussian core, so no Gaussian q over (A, B) is the exact posterior",
    "signorm": "σN is a point-estimated multi-task ensemble (members as point particles of a "
    "LayerNorm-augmented network, NETS), not a Gaussian posterior over the core",
    "ibdr": "a particle mixture draws its component at a discrete auxiliary site, which "
    "TraceMeanField_ELBO refuses (not fully reparameterized); Trace_ELBO reaches the exact mean "
    "with every particle (tests/guides/test_particles.py)",
}


def _out_features(net: nn.Module) -> int:
    """Outputs of the last ``nn.Linear`` of ``net``."""
    return [m for m in net.modules() if isinstance(m, nn.Linear)][-1].out_features


def adapter_for(family: str | None, adapter: Any) -> Any:
    """The adapter the registry-wide problems use for ``family``."""
    transform = ADAPTERS.get(family or "")
    return adapter if transform is None else transform(adapter)


def net_for(family: str | None, net: nn.Module) -> nn.Module:
    """The network the registry-wide problems use for ``family``."""
    transform = NETS.get(family or "")
    return net if transform is None else transform(net)


def options(family: str, likelihood: str = "categorical") -> dict[str, Any]:
    """The ``pb.posterior`` options of ``family`` in the registry-wide tests."""
    extra = GAUSSIAN_OPTIONS.get(family, {}) if likelihood == "gaussian" else {}
    return {**OPTIONS.get(family, {}), **extra}


def posterior(model: Any, family: str, **kwargs: Any) -> Any:
    """``pb.posterior(model, family)`` with the family's registry-test options (``kwargs`` win)."""
    likelihood = getattr(model.likelihood, "name", "categorical")
    return pb.posterior(model, family, **{**options(family, likelihood), **kwargs})


def conformance(family: str) -> dict[str, Any]:
    """``pyrobayes.testing.check_family`` keyword arguments of ``family``: its options, its fit
    settings and the transforms of the kit's tiny problem (the same entries as every
    registry-wide test)."""
    return {
        "options": options(family),
        "adapter": ADAPTERS.get(family),
        "net": NETS.get(family),
        "optimizer": OPTIMIZERS.get(family),
    }
