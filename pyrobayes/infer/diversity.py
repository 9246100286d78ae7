r"""The DPP diversity term of interacting particles (ADP, Pang et al., 2019; IBDR, Pham et al., 2025).

For K particles with class probabilities ``p_k = softmax(f(x; θ_k))`` on one example with label
y, let ``p_k^{−y}`` be ``p_k`` without its y-th entry and ``u_k = p_k^{−y} / ‖p_k^{−y}‖`` (the
normalised non-target prediction). With ``U = [u_1 … u_K] ∈ R^{(C−1)×K}``

.. math:: \ell_{div} = -\log\det(U^\top U + ε I_K)

(Pang et al., 2019, Eq. 4; Pham et al., 2025, Sec. 4). ``Uᵀ U`` holds the cosines between the
particles' non-target predictions, so ``det ∈ [0, 1]``: the term is smallest when the particles
agree on the label and "err differently" (orthogonal non-target vectors). It needs
``C − 1 ≥ K``; with fewer non-target classes the Gram matrix is singular for every input and
the term is the constant ``−K log ε``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["non_target_directions", "diversity_loss", "check_diversity_classes"]

#: Added to ``‖p^{−y}‖`` before normalising (near one-hot predictions have ``p^{−y} → 0``).
NORM_EPS = 1e-12


def check_diversity_classes(num_classes: int, num_particles: int) -> None:
    """Raise unless ``C − 1 ≥ K`` (else ``det(Uᵀ U) ≡ 0`` and the term has no gradient)."""
    if num_classes - 1 < num_particles:
        raise ValueError(
            f"The diversity term needs at least K + 1 classes: with C = {num_classes} classes "
            f"the {num_classes - 1} non-target probabilities of an example span at most "
            f"{num_classes - 1} directions, fewer than the K = {num_particles} particles, so "
            "det(U^T U) is 0 for every input. Use num_particles <= C - 1, or alpha=0 (no "
            "diversity term)."
        )


def non_target_directions(probs: Tensor, targets: Tensor) -> Tensor:
    """``u_k``: unit non-target probability vectors, ``(K, B, C)`` → ``(B, K, C − 1)``.

    Parameters
    ----------
    probs : Tensor ``(K, B, C)``
        Class probabilities of K particles on B examples.
    targets : Tensor ``(B,)``
        Hard class labels (the index removed; soft labels would break the mask).
    """
    num_particles, size, num_classes = probs.shape
    classes = torch.arange(num_classes, device=probs.device).expand(size, num_classes)
    keep = classes != targets.reshape(size, 1)
    index = classes[keep].reshape(size, num_classes - 1)  # non-target classes per example
    rest = probs.gather(-1, index.expand(num_particles, size, num_classes - 1))
    rest = rest / (rest.norm(dim=-1, keepdim=True) + NORM_EPS)
    return rest.transpose(0, 1)  # (B, K, C − 1)


def diversity_loss(probs: Tensor, targets: Tensor, epsilon: float = 1e-7) -> Tensor:
    r"""``ℓ_div = −log det(Uᵀ U + ε I_K)`` per example: ``(K, B, C)`` → ``(B,)``.

    Batched over examples: one ``bmm`` for the ``(B, K, K)`` Gram matrices and one batched
    ``slogdet`` (in float64, so ``ε = 1e-7`` is resolved), no loop over examples.

    Parameters
    ----------
    probs : Tensor ``(K, B, C)``
        Class probabilities of K particles.
    targets : Tensor ``(B,)``
        Hard class labels.
    epsilon : float
        ε, the jitter on the Gram matrix's diagonal.

    Raises
    ------
    ValueError
        When ``C − 1 < K`` (:func:`check_diversity_classes`).
    """
    num_particles, _, num_classes = probs.shape
    check_diversity_classes(num_classes, num_particles)
    u = non_target_directions(probs.to(torch.float64), targets)  # (B, K, C − 1)
    gram = torch.bmm(u, u.transpose(1, 2))  # (B, K, K): cosines
    eye = torch.eye(num_particles, dtype=gram.dtype, device=gram.device)
    _, logdet = torch.linalg.slogdet(gram + epsilon * eye)
    return (-logdet).to(probs.dtype)
