"""An adapter without ``target_modules`` adapts the network's attention query and value
projections, found by name, on every architecture (not only BERT's ``query`` / ``value``)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import pyrobayes as pb
from pyrobayes.models import FineTuneModel, LoRA, LoRAXS
from pyrobayes.models.adapters import adapter_from_dict, attention_target_modules

transformers = pytest.importorskip("transformers")
peft_constants = pytest.importorskip("peft.utils.constants")

#: the predictions here come from a network as built, on purpose
pytestmark = pytest.mark.filterwarnings("ignore::pyrobayes.fitted_head.NeverFittedWarning")

SMALL = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=2)


def _net(model_type: str) -> nn.Module:
    """A tiny Hugging Face model of ``model_type`` built from its config (width 16)."""
    t = transformers
    built = {
        "bert": lambda: t.BertModel(t.BertConfig(**SMALL, hidden_size=16, intermediate_size=32)),
        "llama": lambda: t.LlamaForCausalLM(
            t.LlamaConfig(**SMALL, hidden_size=16, intermediate_size=32)
        ),
        "gpt2": lambda: t.GPT2LMHeadModel(
            t.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2)
        ),
        "gpt_neox": lambda: t.GPTNeoXForCausalLM(
            t.GPTNeoXConfig(**SMALL, hidden_size=16, intermediate_size=32)
        ),
        "opt": lambda: t.OPTForCausalLM(
            t.OPTConfig(
                vocab_size=64,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                ffn_dim=32,
                word_embed_proj_dim=16,
            )
        ),  # fmt: skip
        "t5": lambda: t.T5ForConditionalGeneration(
            t.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
        ),
        "bart": lambda: t.BartForConditionalGeneration(
            t.BartConfig(
                vocab_size=64,
                d_model=16,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=32,
                decoder_ffn_dim=32,
            )
        ),  # fmt: skip
        "deberta-v2": lambda: t.DebertaV2Model(
            t.DebertaV2Config(**SMALL, hidden_size=16, intermediate_size=32)
        ),
        "codegen": lambda: t.CodeGenForCausalLM(
            t.CodeGenConfig(vocab_size=64, n_embd=16, n_layer=2, n_head=2, rotary_dim=4)
        ),
        "bloom": lambda: t.BloomForCausalLM(
            t.BloomConfig(vocab_size=64, hidden_size=16, n_layer=2, n_head=2)
        ),
    }
    torch.manual_seed(0)
    return built[model_type]()


@pytest.mark.parametrize(
    "model_type",
    ["bert", "llama", "gpt2", "gpt_neox", "opt", "t5", "bart", "deberta-v2", "codegen", "bloom"],
)
def test_the_default_adapts_what_peft_adapts_by_default(model_type) -> None:
    """peft's table of default targets per model type is the oracle (its entries for these
    architectures are their attention query / value or fused projections)."""
    expected = peft_constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING[model_type]
    net = _net(model_type)
    assert attention_target_modules(net) == expected
    model = FineTuneModel(net, LoRAXS(rank=2), num_data=8)
    adapted = {s.module_path for s in model.latent_sites.values()}
    paths = {p for p, m in _net(model_type).named_modules() if p.rsplit(".", 1)[-1] in expected}
    assert adapted == paths and adapted


def test_the_default_logs_what_it_adapts_and_equals_the_names_given(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="pyrobayes.models.adapters"):
        default = FineTuneModel(_net("llama"), LoRA(rank=2), num_data=8)
    assert "adapting LlamaForCausalLM's attention projections ['q_proj', 'v_proj']" in caplog.text
    named = FineTuneModel(
        _net("llama"), LoRA(rank=2, target_modules=["q_proj", "v_proj"]), num_data=8
    )
    assert {k: v.shape for k, v in default.latent_sites.items()} == {
        k: v.shape for k, v in named.latent_sites.items()
    }


def test_a_network_without_attention_projections_is_told_to_name_its_modules() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(ValueError, match=r"target_modules was not given.*Sequential.*\['0', '2'\]"):
        FineTuneModel(net, LoRA(rank=2), num_data=8)


def test_a_saved_default_adapter_reloads_onto_the_same_modules(tmp_path) -> None:
    model = FineTuneModel(_net("gpt2"), LoRAXS(rank=2), num_data=8)
    assert model.adapter.to_dict()["target_modules"] is None
    guide = pb.posterior(model, "map")
    pb.save(guide, tmp_path / "posterior.safetensors")
    other = FineTuneModel(_net("gpt2"), LoRAXS(rank=2), num_data=8)
    reloaded = pb.load(tmp_path / "posterior.safetensors", other)
    assert list(reloaded.model.latent_sites) == list(model.latent_sites)
    for name, tensor in guide.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, rtol=0, atol=0)
    again = adapter_from_dict(model.adapter.to_dict())
    assert again.target_modules is None and again == model.adapter


def test_a_peft_config_without_targets_is_still_refused_with_the_default_named() -> None:
    peft = pytest.importorskip("peft")
    with pytest.raises(ValueError, match=r"target_modules=None.*fc1 and fc2 on Phi.*LoRA\(\)"):
        LoRA.from_peft(peft.LoraConfig(r=2, lora_alpha=4))


def test_an_explicit_name_that_matches_nothing_names_the_default() -> None:
    with pytest.raises(ValueError, match=r"target_modules=\['c_attn'\] adapts them"):
        FineTuneModel(_net("gpt2"), LoRA(rank=2, target_modules=["query", "value"]), num_data=8)


def test_the_causal_lm_job_adapts_the_attention_of_any_decoder_by_default() -> None:
    """The multiple-choice job leaves ``adapter.target_modules`` unset: LLaMA's q_proj/v_proj
    as before, GPT-NeoX's fused query_key_value (the old default, q_proj/v_proj, matched none)."""
    from pyrobayes.demo import causal_lm
    from pyrobayes.demo.pipeline import ConfigError

    config = causal_lm.resolve_config({"families": ["map"], "causal_lm": {"task": {"path": "t"}}})
    assert "target_modules" not in config["adapter"]
    for model_type, names in (("llama", {"q_proj", "v_proj"}), ("gpt_neox", {"query_key_value"})):
        net = _net(model_type)
        model = causal_lm.build_model(config, net, num_data=8, seed=0)
        assert {s.module_path.rsplit(".", 1)[-1] for s in model.latent_sites.values()} == names
    with pytest.raises(ConfigError, match=r"'adapter.target_modules' must be a string .* got 3"):
        causal_lm.resolve_config({"families": ["map"], "adapter": {"target_modules": 3}})


def _distilbert_folder(path) -> str:
    """A saved tiny DistilBERT classifier with a word-piece tokenizer (no download)."""
    t = transformers
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "good", "bad", "film"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    t.DistilBertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
    config = t.DistilBertConfig(
        vocab_size=len(vocab), dim=16, n_layers=2, n_heads=2, hidden_dim=32, num_labels=2
    )
    t.DistilBertForSequenceClassification(config).save_pretrained(path)
    return str(path)


def test_the_classification_job_adapts_another_models_attention_by_default(tmp_path) -> None:
    """``pyrobayes fit``'s default targets are MiniLM's own paths; with another ``model.name``
    and no ``adapter.target_modules`` it adapts that model's attention (DistilBERT's q_lin and
    v_lin: MiniLM's regex matched none of its modules)."""
    from pyrobayes.demo import config as demo_config
    from pyrobayes.demo.pipeline import build_model

    assert "target_modules" in demo_config.resolve_config({})["adapter"]  # MiniLM's paths kept
    config = demo_config.resolve_config({"model": {"name": _distilbert_folder(tmp_path)}})
    assert "target_modules" not in config["adapter"]
    model, _ = build_model(config, num_data=8)
    adapted = {s.module_path.rsplit(".", 1)[-1] for s in model.latent_sites.values()}
    assert adapted == {"q_lin", "v_lin"}
    named = {"model": {"name": str(tmp_path)}, "adapter": {"target_modules": ["q_lin"]}}
    assert demo_config.resolve_config(named)["adapter"]["target_modules"] == ["q_lin"]


class _Attention(nn.Module):
    """A hand-written attention whose projections are named ``names`` (Linear 8 -> 8 each)."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        for name in names:
            self.add_module(name, nn.Linear(8, 8))


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("qkv", "proj"), ["qkv"]),  # timm's ViT, torchvision's Swin
        (("wq", "wk", "wv", "wo"), ["wq", "wv"]),  # Meta's reference LLaMA
        (("to_q", "to_k", "to_v", "to_out"), ["to_q", "to_v"]),  # diffusers, hand-written
        (("to_qkv", "to_out"), ["to_qkv"]),
        (("q", "k", "v", "o"), ["q", "v"]),  # T5, MPNet
        (("q_proj", "k_proj", "v_proj", "qkv"), ["q_proj", "v_proj", "qkv"]),  # two conventions
        (("q_proj", "k_proj"), []),  # a query without its value is no pair
    ],
)
def test_the_default_finds_the_usual_names_of_hand_written_attentions(names, expected) -> None:
    net = nn.ModuleDict({"attn": _Attention(*names), "mlp": nn.Linear(8, 8)})
    assert attention_target_modules(net) == expected


def test_multihead_attention_is_named_with_the_layers_to_adapt_instead() -> None:
    """nn.TransformerEncoderLayer's attention has no projection layer an adapter can wrap."""
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, batch_first=True)
    net = nn.Sequential(nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False))
    with pytest.raises(ValueError, match=r"nn\.MultiheadAttention.*in_proj_weight.*'linear1'"):
        FineTuneModel(net, LoRA(rank=2), num_data=8)
    model = FineTuneModel(net, LoRA(rank=2, target_modules=["linear1", "linear2"]), num_data=8)
    assert len(model.latent_sites) == 8  # 2 layers x 2 linears x (A, B)


def test_an_attention_that_reads_its_projections_itself_is_named_by_the_default() -> None:
    """torchvision's Swin names its fused projection ``qkv`` but passes its weight to F.linear
    itself: the default does not pick it and says why."""
    torchvision = pytest.importorskip("torchvision")
    net = torchvision.models.swin_t(num_classes=3)
    with pytest.raises(ValueError, match=r"'features\.1\.0\.attn\.qkv' is the qkv projection.*MLP"):
        FineTuneModel(net, LoRA(rank=2), num_data=8)
