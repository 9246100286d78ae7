r"""The site packing of joint posteriors: every site laid flat in one vector, and back.

A joint Gaussian posterior (SWAG's low-rank-plus-diagonal Gaussian, a full or low-rank
``MultivariateNormal``) is a distribution over ``θ = concat_l vec(θ_l)``, the latent sites laid
flat in site order, as Pyro's :class:`~pyro.infer.autoguide.AutoContinuous` lays out its latent
vector (its ``_unpack_latent``). Two pieces live here:

- :class:`SitePacking`, a mixin for any :class:`~pyrobayes.guides.base.PosteriorGuide`: the
  index map ``site -> slice`` of the flat vector (:attr:`~SitePacking.site_slices`), the flat size
  (:attr:`~SitePacking.flat_dim`), :meth:`~SitePacking.pack` (sites → ``(..., d)``) and
  :meth:`~SitePacking.unpack` (``(..., d)`` → sites). SWAG, Laplace and the IVON families use it
  (a Laplace posterior is block-diagonal over sites, so it only packs; IVON lays its perturbation
  flat with it).
- :class:`JointGaussianGuide`, the base of a family whose ``q`` is one distribution over the
  flat vector: it implements the whole guide contract (Pyro sample sites, ``rsample``,
  ``log_prob``, per-site marginals, ``mean``) from one method, :meth:`joint_posterior`.

A family written outside the package subclasses :class:`JointGaussianGuide`, allocates its
parameters in :meth:`~JointGaussianGuide._setup_joint` and returns its distribution from
:meth:`~JointGaussianGuide.joint_posterior` (see docs/conformance.md for a complete example).
"""

from __future__ import annotations

from collections.abc import Mapping

import pyro
import pyro.distributions as dist
import torch
from torch import Tensor
from torch.distributions.transforms import ReshapeTransform

from ..batch import compute_dtype
from .base import PosteriorGuide

__all__ = ["SitePacking", "JointGaussianGuide", "marginal"]


class SitePacking:
    """Mixin: the guide's sites (``self.sites``, in order) laid flat in one vector of size ``d``.

    Site ``l`` of shape ``shape_l`` occupies ``flat[..., a_l:b_l]`` with ``b_l − a_l =
    numel(shape_l)``, row-major (``value.reshape(-1)``), the sites in ``self.sites``'s order.
    """

    #: the sites' dtype, once set up: draws of a joint kept in another (float32 moments of a
    #: bf16 network's sites) are cast back to it by :meth:`unpack`
    _value_dtype: torch.dtype | None = None

    sites: dict[str, torch.Size]

    @property
    def site_slices(self) -> dict[str, slice]:
        """``{site: slice(a, b)}``: where each site lives in the flat vector."""
        key = tuple((s, tuple(shape)) for s, shape in self.sites.items())
        cached = self.__dict__.get("_site_slices")
        if cached is None or cached[0] != key:
            slices, start = {}, 0
            for site, shape in self.sites.items():
                end = start + int(torch.Size(shape).numel())
                slices[site] = slice(start, end)
                start = end
            cached = self.__dict__["_site_slices"] = (key, slices, start)
        return cached[1]

    @property
    def flat_dim(self) -> int:
        """``d``, the number of site entries (the length of the flat vector)."""
        self.site_slices  # noqa: B018 - fills the cache
        return int(self.__dict__["_site_slices"][2])

    def pack(self, values: Mapping[str, Tensor]) -> Tensor:
        """``{site: (*lead, *shape)}`` → ``(*lead, d)``, the sites concatenated in site order.

        Raises
        ------
        KeyError
            A site of the guide is missing from ``values`` (the message names it).
        """
        parts = []
        for site, shape in self.sites.items():
            if site not in values:
                raise KeyError(
                    f"pack: no value for site {site!r}; pass every site of the guide "
                    f"({list(self.sites)})."
                )
            v = values[site]
            parts.append(v.reshape(*v.shape[: v.dim() - len(shape)], -1))
        return torch.cat(parts, -1)

    def unpack(self, flat: Tensor) -> dict[str, Tensor]:
        """``(*lead, d)`` → ``{site: (*lead, *shape)}`` (views of ``flat`` where possible)."""
        if flat.shape[-1] != self.flat_dim:
            raise ValueError(
                f"unpack: expected a last dimension of {self.flat_dim} (the guide's flat size) "
                f"but got shape {tuple(flat.shape)}."
            )
        lead = flat.shape[:-1]
        if self._value_dtype is not None and compute_dtype(self._value_dtype) != self._value_dtype:
            flat = flat.to(self._value_dtype)  # only a half-precision network's draws
        return {
            s: flat[..., sl.start : sl.stop].reshape(*lead, *self.sites[s])
            for s, sl in self.site_slices.items()
        }


def marginal(joint: dist.Distribution, index: slice) -> dist.Distribution:
    """The marginal of a Gaussian ``joint`` over ``(d,)`` on the coordinates ``index``.

    Supported: ``LowRankMultivariateNormal``, ``MultivariateNormal`` and a diagonal
    ``Normal(loc, scale).to_event(1)``.
    """
    if isinstance(joint, dist.LowRankMultivariateNormal):
        return dist.LowRankMultivariateNormal(
            joint.loc[index], joint.cov_factor[index], joint.cov_diag[index]
        )
    if isinstance(joint, dist.MultivariateNormal):
        return dist.MultivariateNormal(
            joint.loc[index], scale_tril=_marginal_tril(joint.covariance_matrix[index, index])
        )
    base = getattr(joint, "base_dist", None)
    if isinstance(joint, dist.Independent) and isinstance(base, dist.Normal):
        return dist.Normal(base.loc[index], base.scale[index]).to_event(1)
    raise NotImplementedError(
        f"marginal: no marginal rule for {type(joint).__name__}; override get_posterior(site) "
        "in the family."
    )


def _marginal_tril(cov: Tensor) -> Tensor:
    return torch.linalg.cholesky(0.5 * (cov + cov.mT))


class JointGaussianGuide(SitePacking, PosteriorGuide):
    r"""Base of a posterior that is one distribution over all sites laid flat.

    A subclass provides :meth:`joint_posterior` (a distribution with event shape ``(d,)`` over
    :meth:`~SitePacking.pack`'s layout) and allocates its parameters in :meth:`_setup_joint`;
    everything else follows:

    - ``forward`` samples the flat vector once at an auxiliary Pyro site
      ``_<name>_latent`` and emits every site as a ``Delta`` of its slice (Pyro's
      ``AutoContinuous`` layout), so ``SVI``, ``Predictive`` and Pyro's ELBOs work;
    - ``rsample(S)`` = ``unpack(joint.rsample((S,)))``; ``log_prob(values)`` =
      ``joint.log_prob(pack(values))``;
    - ``get_posterior(site)`` is the Gaussian marginal on the site's slice (:func:`marginal`),
      reshaped to the site's shape; ``mean()`` unpacks the joint mean.
    """

    # ------------------------------------------------------------------ set-up
    def _setup_site(self, site: str, init: Tensor) -> None:
        """Per-site parameters (none by default: a joint family allocates in :meth:`_setup_joint`)."""

    def _setup_sites(self, inits: Mapping[str, Tensor]) -> None:
        super()._setup_sites(inits)
        flat = self.pack({s: v.detach() for s, v in inits.items()})
        self._value_dtype = flat.dtype
        self._setup_joint(flat)

    def _setup_joint(self, flat_init: Tensor) -> None:
        """Allocate the joint parameters, given the sites' initial values laid flat ``(d,)``."""

    # ------------------------------------------------------------------ the joint distribution
    def joint_posterior(self) -> dist.TorchDistribution:
        """``q`` over the flat vector: a distribution with event shape ``(d,)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement joint_posterior().")

    def sample_flat(self, num_samples: int = 1) -> Tensor:
        """Differentiable flat draws ``(num_samples, d)`` of :meth:`joint_posterior`."""
        self.require_setup()
        return self.joint_posterior().rsample((num_samples,))

    # ------------------------------------------------------------------ guide contract
    def get_posterior(self, site: str) -> dist.TorchDistribution:
        shape = self.sites[site]
        index = self.site_slices[site]
        part = marginal(self.joint_posterior(), index)
        size = torch.Size([index.stop - index.start])
        return dist.TransformedDistribution(part, [ReshapeTransform(size, torch.Size(shape))])

    def _pyro_sample_sites(self) -> dict[str, Tensor]:
        flat = pyro.sample(
            f"_{self._pyro_name}_latent", self.joint_posterior(), infer={"is_auxiliary": True}
        )
        return {
            s: pyro.sample(s, dist.Delta(v, event_dim=len(self.sites[s])))
            for s, v in self.unpack(flat).items()
        }

    def rsample(self, num_samples: int = 1) -> dict[str, Tensor]:
        return self.unpack(self.sample_flat(num_samples))

    def log_prob(self, values: Mapping[str, Tensor]) -> Tensor:
        return self.joint_posterior().log_prob(self.pack(values))

    def mean(self) -> dict[str, Tensor]:
        self.require_setup()
        with torch.no_grad():
            return {
                s: v.detach().clone() for s, v in self.unpack(self.joint_posterior().mean).items()
            }
