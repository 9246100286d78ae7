"""The stack of blocks the lower layers are shared below (:func:`pyrobayes.models.sharing.
block_stack`): an ``nn.Sequential`` that chains blocks of one type (torchvision's
``VisionTransformer`` keeps its encoder blocks in ``encoder.layers``, Swin the blocks of a stage),
and, among the lists of identical blocks, the one holding the adapted parameters (a Wav2Vec2
whose convolutional feature encoder is longer than its transformer's layer list)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.sharing import block_stack, first_adapted_block, lower_inputs, unshared

torchvision = pytest.importorskip("torchvision")
transformers = pytest.importorskip("transformers")

#: the draws' predictions here come from networks as built, on purpose
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

#: float64 throughout: the shared forward runs the lower blocks on the B rows instead of the
#: S·B copies, the same arithmetic per row but for the kernels' blocking of the batch, so the
#: two differ by rounding only: a handful of float64 ulps (eps 2.2e-16) through six blocks of
#: width <= 64 on outputs of order 1, measured 0 to 6e-16 here. A draw applied to another
#: row, or a block skipped, moves the outputs by 1e-3 or more (checked below).
TOL = 1e-12


def _draws(model: FineTuneModel, num: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        site: model.site_value(site)
        + 0.5 * torch.randn(num, *spec.shape, generator=g, dtype=torch.float64)
        for site, spec in model.latent_sites.items()
    }


def _rows_into(block: nn.Module) -> list[int]:
    """The rows of the hidden states ``block`` is called on, call by call (recorded)."""
    rows: list[int] = []

    def record(module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        rows.append(int(hidden.shape[0]))

    block.register_forward_pre_hook(record, with_kwargs=True)
    return rows


def _shared_and_plain(
    model: FineTuneModel, inputs: torch.Tensor | dict[str, torch.Tensor], num: int
) -> tuple[torch.Tensor, torch.Tensor]:
    values = _draws(model, num)
    with torch.no_grad():
        shared = model.batched_output(inputs, values)
        with unshared():
            plain = model.batched_output(inputs, values)
    return shared, plain


def _tv_vit() -> FineTuneModel:
    """The brief's tiny torchvision ViT (6 blocks in an ``nn.Sequential``), LoRA on the MLPs of
    the top 2 blocks, in float64."""
    torch.manual_seed(0)
    net = torchvision.models.VisionTransformer(
        image_size=32, patch_size=8, num_layers=6, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=3,
    )  # fmt: skip
    nn.init.normal_(net.heads.head.weight, std=0.3)  # torchvision's new head is zeros
    net = net.double().eval()
    adapter = LoRA(rank=2, target_modules=r".*encoder_layer_(4|5)\.mlp\.(0|3)")
    return FineTuneModel(net, adapter, num_data=8, trainable_modules=["heads"])


@pytest.mark.parametrize("positional", [False, True])
def test_a_torchvision_vit_runs_its_blocks_below_the_adapted_ones_once_for_all_draws(
    positional: bool,
):
    """torchvision's ViT keeps its blocks in ``encoder.layers``, an ``nn.Sequential``: before,
    no stack was found and every block ran S times (block 0 on S·B = 16·3 rows). The images of
    torchvision's ``(x, y)`` batches reach the network as a bare tensor (``positional``), which
    the sharing took only as a dict of keywords before."""
    model = _tv_vit()
    found = model._first_adapted()
    assert found is not None and found[1] == 4
    assert list(found[0]) == list(model.net.encoder.layers)
    assert block_stack(model.net) is model.net.encoder.layers
    bottom = _rows_into(model.net.encoder.layers[0])
    top: list[int] = []  # the rows out of the first adapted block
    model.net.encoder.layers[4].register_forward_hook(lambda m, a, out: top.append(len(out)))
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    shared, plain = _shared_and_plain(model, x if positional else {"x": x}, 16)
    assert bottom == [3, 16 * 3]  # shared: once on the 3 rows; unshared: on the 48
    assert top == [16 * 3, 16 * 3]
    torch.testing.assert_close(shared, plain, rtol=0, atol=TOL)
    assert float((shared[0] - shared[1]).abs().max()) > 1e-3  # the draws reach the output


def test_a_torchvision_swin_stage_is_the_stack_of_its_adapted_block():
    """Swin's stages are ``nn.Sequential``\\ s of blocks inside a ``features`` ``nn.Sequential``
    of mixed types: the stage holding the adapter is the stack, exact against the unshared
    forward."""
    torch.manual_seed(0)
    net = torchvision.models.swin_transformer.SwinTransformer(
        patch_size=[4, 4], embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=[4, 4],
        num_classes=3,
    ).double().eval()  # fmt: skip
    adapter = LoRAXS(rank=2, target_modules=r".*features\.3\.1\.mlp\.(0|3)", init_scale=0.1)
    model = FineTuneModel(net, adapter, num_data=8, trainable_modules=["head"])
    found = model._first_adapted()
    assert found is not None and found[1] == 1 and list(found[0]) == list(net.features[3])
    bottom = _rows_into(net.features[0])
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    shared, plain = _shared_and_plain(model, {"x": x}, 4)
    assert bottom == [3, 4 * 3]
    torch.testing.assert_close(shared, plain, rtol=0, atol=TOL)
    assert float((shared[0] - shared[1]).abs().max()) > 1e-3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class _Reversed(nn.Sequential):
    """A sequential container with a forward of its own: its members run last first."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self):
            x = block(x)
        return x


def test_a_sequential_that_does_not_chain_its_members_or_a_list_of_lists_is_no_stack():
    """A subclass of ``nn.Sequential`` with its own forward may not run its members in order
    (sharing below its block 2 would skip blocks 1 and 0, which run after it), and a list of
    lists has no forward to share below: neither is taken for the stack."""
    chained = nn.Sequential(_Block(), _Block(), _Block())
    reversed_ = _Reversed(_Block(), _Block(), _Block())
    lists = nn.ModuleList([nn.ModuleList([_Block()]) for _ in range(3)])
    assert block_stack(chained) is chained
    assert block_stack(reversed_) is None
    assert block_stack(nn.Module().add_module("lists", lists) or lists) is None
    assert first_adapted_block(reversed_, ["2.proj.weight"]) is None
    found = first_adapted_block(chained, ["2.proj.weight"])
    assert found is not None and found[1] == 2 and list(found[0]) == list(chained)


def test_the_stack_is_the_list_holding_the_adapted_parameters_not_the_longest():
    """Two sibling lists of identical blocks: the longer one holds no adapted parameter, the
    shorter one all of them. Before, the longer one was the stack and nothing was shared."""
    net = nn.Module()
    net.long = nn.ModuleList([_Block() for _ in range(5)])
    net.short = nn.ModuleList([_Block() for _ in range(3)])
    assert block_stack(net) is net.long
    assert block_stack(net, ["short.2.proj.weight"]) is net.short
    assert block_stack(net, ["short.2.proj.weight", "long.4.proj.weight"]) is None
    found = first_adapted_block(net, ["short.2.proj.weight", "short.1.proj.bias"])
    assert found is not None and found[0] is net.short and found[1] == 1


def _wav2vec2() -> FineTuneModel:
    """A tiny Wav2Vec2 classifier with 3 convolutions (LayerNorm feature encoder: one conv
    layer type, a ModuleList of 3) and 2 transformer layers, LoRA on the top layer, float64."""
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2, num_labels=3,
        feat_extract_norm="layer", do_stable_layer_norm=True, mask_time_prob=0.0,
        classifier_proj_size=16, initializer_range=0.2,
        conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
    )  # fmt: skip
    net = transformers.Wav2Vec2ForSequenceClassification(config).double().eval()
    adapter = LoRA(rank=2, target_modules=r".*encoder\.layers\.1\..*(q_proj|v_proj)")
    return FineTuneModel(net, adapter, num_data=3)


def test_a_wav2vec2_with_more_convolutions_than_layers_shares_its_lower_layer():
    """The feature encoder's 3 convolutions were the longest list of identical blocks, so the
    stack held no adapted parameter and transformer layer 0 ran for every draw (on S·B rows)."""
    model = _wav2vec2()
    encoder = model.net.wav2vec2.encoder
    assert len(model.net.wav2vec2.feature_extractor.conv_layers) > len(encoder.layers)
    found = model._first_adapted()
    assert found is not None and found[0] is encoder.layers and found[1] == 1
    bottom = _rows_into(encoder.layers[0])
    waves = torch.randn(3, 400, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    shared, plain = _shared_and_plain(model, {"input_values": waves}, 4)
    assert bottom == [3, 4 * 3]
    torch.testing.assert_close(shared, plain, rtol=0, atol=TOL)
    assert float((shared[0] - shared[1]).abs().max()) > 1e-3


def test_positional_inputs_are_cut_to_one_draws_rows():
    """A plain network's positional inputs (torchvision's images, a tensor or a tuple) are cut
    to the first B rows of the S·B like its keywords; a tensor of other rows is left alone."""
    net = nn.Linear(2, 2)
    x, other = torch.arange(12.0).reshape(6, 2), torch.zeros(5, 2)
    assert torch.equal(lower_inputs(net, x, 2, 3), x[:2])
    cut = lower_inputs(net, (x, other), 2, 3)
    assert isinstance(cut, tuple) and torch.equal(cut[0], x[:2]) and cut[1] is other
    assert torch.equal(lower_inputs(net, [x], 2, 3)[0], x[:2])
    assert torch.equal(lower_inputs(net, {"x": x}, 2, 3)["x"], x[:2])


def test_predict_sizes_its_chunks_of_draws_by_an_images_patches_not_by_one_row():
    """On CPU, ``pb.predict`` puts as many draws in one forward as keep it within 1,024 work
    units. An image counted as one row (an MLP's) put all 16 draws of 8 images of 224² in one
    forward of 128 ViT images (a 197-token sequence each: attention maps of 0.9 GB at ViT-B's 12
    heads); counted by its 16 × 16 patches (196 each) it is one draw per forward. With the
    lower blocks shared, a draw adds only the blocks at or above the first adapted one."""
    from pyrobayes.batch import image_tokens
    from pyrobayes.predictive import default_samples_per_forward

    cpu = torch.device("cpu")
    images = torch.zeros(8, 3, 224, 224)
    assert image_tokens(images) == 8 * 196
    assert image_tokens({"pixel_values": images}) == 8 * 196
    assert image_tokens((images, torch.zeros(8))) == 8 * 196
    assert image_tokens(torch.zeros(8, 3, 8, 8)) == 8  # at least one unit per image
    assert image_tokens(torch.zeros(8, 64)) is None  # not an image batch
    assert image_tokens({"input_ids": torch.zeros(8, 5, dtype=torch.long)}) is None
    assert default_samples_per_forward(16, cpu, images) == 1
    assert default_samples_per_forward(16, cpu, {"pixel_values": images}) == 1
    assert default_samples_per_forward(16, cpu, torch.zeros(8, 64)) == 16  # rows, as before

    model = _tv_vit()  # 6 blocks, LoRA on blocks 4-5: a draw adds 2/6 of the blocks' work
    x = torch.zeros(8, 3, 32, 32, dtype=torch.float64)  # 4 units (patches of 16²) per image
    assert model.tokens_per_draw(x) == -(-8 * 4 * 2 // 6)
    with unshared():
        assert model.tokens_per_draw(x) is None
    assert default_samples_per_forward(16, cpu, x, model) == 16  # 11 units a draw: all 16
