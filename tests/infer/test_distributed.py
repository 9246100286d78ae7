"""``pb.fit`` under ``torch.distributed`` (gloo, 2 CPU processes) equals one process.

With equal per-rank batch sizes, two ranks on halves of each batch must follow the trajectory of
one process on the whole batch: each rank's loss is ``(N/B) Σ_{b∈rank} log p + (prior or KL)``,
and the average of the two ranks' gradients is the gradient of ``(N/2B) Σ_b log p + ...``, the
single-process loss on the union batch. The draws are the same on both ranks (same seed), so the
stochastic families (mean-field ELBO, IVON, Kronecker IVON, whose curvature statistics are
all-reduced) reduce exactly too. "kron-ivon+pad" runs Kronecker IVON on padded token batches
(tiny BERT) whose halves hold different numbers of real tokens: the input factor must pool the
ranks' token rows (Σ aᵀa / Σ rows), as one process does, not average the ranks' Â. Agreement is to float64 round-off, accumulated over the steps
(the two ways sum the batch in a different order): rtol 1e-7.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from torch import nn

import pyrobayes as pb
from tests.common import mlp, split_batches

pytestmark = pytest.mark.integration  # every test spawns two gloo ranks

# "map+val": MAP with validation selection; the ranks hold uneven shares of the validation set
FAMILIES = ("map", "meanfield", "ivon", "kron-ivon", "map+val", "kron-ivon+pad")
NUM_DATA, BATCH, STEPS = 96, 16, 12
LR = {"map": 1e-2, "meanfield": 1e-2, "ivon": 0.05, "kron-ivon": 0.05, "map+val": 5e-2}
LR["kron-ivon+pad"] = 0.05
HEAD = {"kron-ivon+pad": "classifier.weight"}  # a point parameter the fit must move


def _adapted(net: nn.Module, rank: int, targets: list[str], head: str) -> pb.models.FineTuneModel:
    """``net`` with LoRA-XS cores on ``targets`` and the point-estimated ``head``."""
    lora = pb.models.LoRAXS(rank=rank, target_modules=targets, init_scale=0.1)
    return pb.models.FineTuneModel(net, lora, trainable_modules=[head], num_data=NUM_DATA)


def _token_problem() -> tuple[pb.models.FineTuneModel, list[dict[str, torch.Tensor]]]:
    from tests.common import tiny_bert

    torch.manual_seed(0)
    net = tiny_bert(num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _adapted(net, 2, ["query", "value"], "classifier")
    g = torch.Generator().manual_seed(1)
    T = 9
    ids = torch.randint(1, 90, (NUM_DATA, T), generator=g)
    # first half of every batch (rank 0's share) short sentences, second half long ones
    lengths = torch.tensor([2, 3, 4, 3, 2, 4, 3, 2, 9, 8, 9, 7, 9, 8, 9, 9]).repeat(
        NUM_DATA // BATCH
    )
    mask = (torch.arange(T) < lengths[:, None]).long()
    ids = ids * mask
    labels = (ids[:, 0] % 2).long()
    batches = [
        {
            "input_ids": ids[i : i + BATCH],
            "attention_mask": mask[i : i + BATCH],
            "labels": labels[i : i + BATCH],
        }
        for i in range(0, NUM_DATA, BATCH)
    ]
    return model, batches


def _problem(
    family: str,
) -> tuple[pb.models.FineTuneModel, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = _adapted(mlp(5, 16, 16, 3), 3, ["0", "2"], "4")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_DATA, 5, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return model, split_batches(x, y, BATCH)


def _fit(family: str, rank: int | None) -> dict[str, torch.Tensor]:
    model, batches = _token_problem() if family.endswith("+pad") else _problem(family)
    if rank is not None:  # this rank's half of every batch (a DistributedSampler's share)
        part = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
        batches = [
            {k: v[part] for k, v in b.items()} if isinstance(b, dict) else (b[0][part], b[1][part])
            for b in batches
        ]
    guide = pb.posterior(model, family.removesuffix("+val").removesuffix("+pad"))
    if family == "map+val":
        # half 0 has the training rule's labels (improves with training), half 1 other labels
        # (worsens): alone, half 0 selects the last epoch and half 1 the first (measured), so
        # ranks that did not average their scores would restore different states
        g = torch.Generator().manual_seed(2)
        vx = torch.randn(2 * BATCH, 5, generator=g)
        vy = (vx[:, 0] + vx[:, 1] > 0).long() + (vx[:, 2] > 1).long()
        vy[BATCH:] = (vy[BATCH:] + 1) % 3
        # uneven shards (12 and 20 examples): the ranks' metrics are pooled over the union,
        # not averaged as two means (which would weigh rank 0's examples 5/3 times as much)
        cut = BATCH - 4
        halves = [(vx[:cut], vy[:cut]), (vx[cut:], vy[cut:])]
        val = [halves[rank]] if rank is not None else [(vx, vy)]
        result = pb.fit(
            model,
            guide,
            batches,
            epochs=6,
            lr=LR[family],
            seed=3,
            validation=pb.Validation(val, select_by="nll"),
        )
        history = result.state["validation"]
        state = {
            "best_epoch": torch.tensor(result.state["best_epoch"]),
            "validation": torch.tensor([[h["nll"], h["accuracy"]] for h in history]),
        }
    else:
        pb.fit(model, guide, batches, optim=pb.Optimization(num_steps=STEPS), lr=LR[family], seed=3)
        state = {}
    state |= {f"guide.{k}": v.detach().clone() for k, v in guide.state_dict().items()}
    state.update({f"model.{k}": v.detach().clone() for k, v in model.point_params.items()})
    return state


def _worker(rank: int, init_file: str, out_dir: str, job: str = "fit") -> None:
    """One gloo rank: ``job`` "fit" (every family of :data:`FAMILIES`), "laplace" (every
    structure of :data:`STRUCTURES`) or "uneven", its results saved as ``<job><rank>.pt``."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    torch_dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    try:
        if job == "fit":
            results = {family: _fit(family, rank) for family in FAMILIES}
        elif job == "laplace":
            results = {s: _laplace(s, rank) for s in STRUCTURES}
        elif job == "unsplit":
            results = _unsplit_laplace(rank)
        else:  # "uneven": rank 1 holds one batch fewer
            model, batches = _problem("map")
            try:
                pb.fit(model, pb.posterior(model, "map"), batches[: len(batches) - rank], epochs=1)
                results = {"raised": "nothing"}
            except ValueError as err:
                results = {"raised": str(err)}
        torch.save(results, os.path.join(out_dir, f"{job}{rank}.pt"))
        torch_dist.barrier()  # both ranks done before the teardown (see _nan_worker)
    finally:
        torch_dist.destroy_process_group()
    _exit_without_finalizers()


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    if not torch_dist.is_available():
        pytest.skip("torch.distributed is not available in this torch build")
    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_worker, args=(str(tmp / "init"), str(tmp)), nprocs=2, join=True)
    return [torch.load(tmp / f"fit{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("family", FAMILIES)
def test_two_gloo_ranks_equal_one_process_on_the_union_batch(distributed_results, family):
    single = _fit(family, None)
    r0, r1 = distributed_results[0][family], distributed_results[1][family]
    assert set(r0) == set(single)
    for key, value in single.items():
        torch.testing.assert_close(r0[key], r1[key], rtol=0, atol=0, msg=f"ranks differ: {key}")
        torch.testing.assert_close(r0[key], value, rtol=1e-7, atol=1e-10, msg=key)
    # the fit moved the parameters: the comparison is not between two untouched inits
    model, _ = _token_problem() if family.endswith("+pad") else _problem(family)
    name = HEAD.get(family, "4.weight")
    head = model.point_params[name]
    assert (single[f"model.{name}"] - head).abs().max() > 1e-3


def test_nonfinite_loss_stops_every_rank(tmp_path: Path) -> None:
    # one rank sees a NaN input: both raise (no rank left waiting in an all-reduce)
    mp.spawn(_nan_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        assert (tmp_path / f"raised{rank}").read_text() == "FloatingPointError"


def _nan_worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_default_dtype(torch.float64)
    torch_dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    try:
        model, batches = _problem("map")
        x, y = batches[0]
        x = x.clone()
        if rank == 1:
            x[0, 0] = float("nan")
        guide = pb.posterior(model, "map")
        try:
            pb.fit(model, guide, [(x, y)], optim=pb.Optimization(num_steps=2), seed=0)
            raised = "nothing"
        except FloatingPointError:
            raised = "FloatingPointError"
        Path(out_dir, f"raised{rank}").write_text(raised)
        # both ranks done before either tears the group down: a rank destroying its gloo group
        # while the other still finishes its step aborted the latter (SIGABRT, 4 runs in 24)
        torch_dist.barrier()
    finally:
        torch_dist.destroy_process_group()
    _exit_without_finalizers()


def _exit_without_finalizers() -> None:
    """End a spawned rank whose results are on disk without the interpreter's finalization.

    A spawned worker otherwise exits through ``sys.exit``: the interpreter tears down and C++
    static destructors run while gloo's transport threads may still be joinable, which aborts
    the process ("terminate called without an active exception", SIGABRT; 1 run in 70 of the
    non-finite test with the barrier above, 4 in 24 without it; gloo's worker threads crashing
    interpreter finalization is pytorch/pytorch#179291). That teardown is torch's, after
    everything this test checks; ``os._exit`` skips it (the files are written and closed)."""
    os._exit(0)


# ------------------------------------------------------------------------------------------------
# Laplace's curvature pass under torch.distributed: each rank holds its share of every batch, and
# the curvature is summed over ranks, so every rank gets the posterior of one process whose
# batches are the ranks' shares (laplace-torch adds its Kronecker factors batch by batch, so that
# is the batching a K-FAC curvature depends on; the diagonal GGN is a sum over examples). Before,
# each rank fitted the curvature and tau of its own half (tau 2.89 vs 3.05 vs 1.93 in one process).
# ------------------------------------------------------------------------------------------------

STRUCTURES = ("kron", "diag")


def _laplace(structure: str, rank: int | None) -> dict[str, torch.Tensor]:
    model, batches = _problem("laplace")
    shares = [
        [(x[part], y[part]) for x, y in batches]
        for part in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH))
    ]
    # one process: the ranks' shares as its batches, in turn; a rank: its own shares
    data = [b for pair in zip(*shares, strict=True) for b in pair] if rank is None else shares[rank]
    guide = pb.posterior(model, "laplace", structure=structure)
    pb.fit(model, guide, data, epochs=0)  # post hoc at the model's point: the curvature pass
    state = {k: v.detach().clone() for k, v in guide.state_dict().items()}
    if structure == "kron":  # then τ chosen on held-out shards of 12 and 20 examples: the NLL
        # of their union on every rank (the same draws: one seed), so one τ, one process's.
        # Alone, the shards choose 2.2e5 and 2.2e4 here (the second's inputs scaled by 10)
        g = torch.Generator().manual_seed(5)
        vx, vy = torch.randn(32, 5, generator=g), torch.randint(0, 3, (32,), generator=g)
        vx[12:] *= 10
        shards = [[(vx[:12], vy[:12])], [(vx[12:], vy[12:])]]
        val = [(vx, vy)] if rank is None else shards[rank]
        tau = pb.infer.select_prior_precision(model, guide, val, factors=(1e-3, 1e-2, 0.1, 1, 10))
        state["selected_tau"] = torch.tensor(tau)
    return state


def _single_laplace(_: int, out_dir: str) -> None:
    """One process on the union of the ranks' shares, set up as a rank is (float64, one
    thread, a fresh process): the reference of :func:`test_laplace_curvature_is_summed_over_ranks`.
    Computed in the test session's own process, after whatever other tests ran in it, it once
    came out off the ranks' curvature beyond 1e-7 in a clean-clone CI run (not reproduced: in a
    fresh process it is bit-identical to the code of the session before)."""
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    torch.save({s: _laplace(s, None) for s in STRUCTURES}, os.path.join(out_dir, "single.pt"))


def test_laplace_curvature_is_summed_over_ranks(tmp_path: Path) -> None:
    args = (str(tmp_path / "init"), str(tmp_path), "laplace")
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"laplace{r}.pt", weights_only=True) for r in range(2)]
    mp.spawn(_single_laplace, args=(str(tmp_path),), nprocs=1, join=True)
    single = torch.load(tmp_path / "single.pt", weights_only=True)
    for structure in STRUCTURES:
        r0, r1 = ranks[0][structure], ranks[1][structure]
        assert set(r0) == set(single[structure])
        assert any("curv" in k for k in r0), sorted(r0)  # the curvature is in the state
        for key, value in single[structure].items():
            torch.testing.assert_close(r0[key], r1[key], rtol=0, atol=0, msg=f"ranks: {key}")
            # the same sums in another order (the ranks' shares reduced pairwise): float64
            # round-off, amplified by the eigendecomposition of the Kronecker factors
            torch.testing.assert_close(
                r0[key], value, rtol=1e-7, atol=1e-9, msg=lambda m, key=key: f"{key}: {m}"
            )


def _unsplit_laplace(rank: int) -> dict[str, list[str]]:
    """A post-hoc Laplace (no epoch) on every rank's copy of the whole training loader (no
    DistributedSampler), then on the rank's own share: the warnings each fit raised."""
    out = {}
    for name in ("unsplit", "share"):
        model, batches = _problem("laplace")
        if name == "share":
            part = slice(rank * BATCH // 2, (rank + 1) * BATCH // 2)
            batches = [(x[part], y[part]) for x, y in batches]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pb.fit(model, pb.posterior(model, "laplace"), batches, epochs=0)
        out[name] = [str(w.message) for w in caught]
    return out


def test_a_post_hoc_laplace_on_a_loader_not_split_per_rank_warns(tmp_path: Path) -> None:
    # the curvature pass sums over ranks: each rank reading all N examples counted every
    # example twice (posterior sd .447 against one process's .542), in silence, since the
    # fit's per-epoch data-size check never ran on a fit of no epoch
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), "unsplit"), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"unsplit{r}.pt", weights_only=True) for r in range(2)]
    told = [m for m in ranks[0]["unsplit"] if "training data's pass yielded" in m]
    assert len(told) == 1, ranks[0]["unsplit"]
    assert f"{2 * NUM_DATA} examples (2 ranks × {NUM_DATA})" in told[0]
    assert "DistributedSampler" in told[0]
    assert not ranks[1]["unsplit"]  # rank 0 alone warns
    assert not ranks[0]["share"] and not ranks[1]["share"]  # each rank's share: silent


def test_ranks_with_different_numbers_of_batches_are_refused_on_every_rank(tmp_path: Path) -> None:
    # before: the shorter rank returned (its all-reduces paired with the other's steps out of
    # order) and the longer one waited for gloo's timeout (30 minutes by default)
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path), "uneven"), nprocs=2, join=True)
    for rank in range(2):
        raised = torch.load(tmp_path / f"uneven{rank}.pt", weights_only=True)["raised"]
        assert "different numbers of batches per epoch (5 to 6" in raised, raised


def test_cpu_tensors_are_staged_on_the_gpu_for_nccl_alone(monkeypatch):
    """Distributed fits all-reduce CPU tensors (Laplace's example count, a calibration or
    validation sum); NCCL reduces CUDA tensors only ("No backend type associated with device
    type cpu"), so under NCCL alone those go through the current CUDA device, while gloo and a
    group with a CPU backend beside NCCL take them as they are. (The NCCL run itself needs two
    GPUs: still to be checked on one.)"""
    from pyrobayes.infer.distributed import staging_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    cpu = torch.zeros(2)
    assert staging_device(cpu, "nccl") == torch.device("cuda", 1)
    assert staging_device(cpu, "gloo") is None
    assert staging_device(cpu, "cpu:gloo,cuda:nccl") is None
    assert staging_device(torch.zeros(2, device="meta"), "nccl") is None  # not a CPU tensor
