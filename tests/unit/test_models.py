"""Flat layer lists: exactness vs Hugging Face, ties, per-layer deterministic init, hf names,
custom factories and local pretrained weights."""

from __future__ import annotations

import textwrap

import pytest
import torch
import transformers
from torch import nn

from oobleck_elastic.config import ModelConfig
from oobleck_elastic.models import (
    LayerModel,
    TiedGroup,
    build_layer_model,
    describe_ties,
    find_tied_parameters,
    flatten_hf_model,
    hf_config,
    layers_from_modules,
)

FAMILIES = ["gpt2", "llama", "mistral", "qwen2"]
HF_CLASS = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}
SEQ = 16


def tiny(family: str = "gpt2", **kw) -> ModelConfig:
    base = dict(
        family=family,
        vocab_size=256,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=None if family == "gpt2" else 2,
        intermediate_size=64,
        max_seq_len=SEQ,
        dropout=0.0,
    )
    base.update(kw)
    return ModelConfig(**base)


def hf_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return getattr(transformers, HF_CLASS[cfg.family])(hf_config(cfg)).eval()


def ids(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, SEQ), generator=torch.Generator().manual_seed(seed))


def run_layers(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def state(layer: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in layer.state_dict(keep_vars=True).items()}


# --------------------------------------------------------------------- exactness vs HF


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("family", FAMILIES)
def test_flat_layers_equal_hf_logits(family, impl):
    model = hf_model(tiny(family, attn_implementation=impl))
    assert model.config._attn_implementation == impl
    lm = flatten_hf_model(model)
    assert lm.names == ["embedding", "block.0", "block.1", "head"]
    x = ids()
    with torch.no_grad():
        ref = model(x).logits
        out = lm.forward(x)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_flat_layers_are_causal_under_eager_and_sdpa(family):
    lm_e = build_layer_model(tiny(family, attn_implementation="eager"), seed=3)
    lm_s = build_layer_model(tiny(family, attn_implementation="sdpa"), seed=3)
    x = ids()
    y = x.clone()
    y[:, -1] = (y[:, -1] + 1) % 256  # change only the last token
    with torch.no_grad():
        e, s, e2 = lm_e.forward(x), lm_s.forward(x), lm_e.forward(y)
    assert torch.allclose(e, s, atol=1e-5)
    assert torch.equal(e[:, :-1], e2[:, :-1])  # earlier positions cannot see the last token
    assert not torch.equal(e[:, -1], e2[:, -1])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_mistral_sliding_window_matches_hf(impl):
    conf = hf_config(tiny("mistral", attn_implementation=impl))
    conf.sliding_window = 4
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(conf).eval()
    x = ids()
    with torch.no_grad():
        assert torch.allclose(flatten_hf_model(model).forward(x), model(x).logits, atol=1e-6)


def test_unsupported_model_class():
    with pytest.raises(TypeError, match="supports GPT2LMHeadModel"):
        flatten_hf_model(nn.Linear(2, 2))


def test_unsupported_attention_implementation():
    with pytest.raises(ValueError, match="'sdpa' or 'eager'"):
        hf_config(tiny(attn_implementation="flex_attention"))


# --------------------------------------------------------------------- ties


def test_ties_gpt2_and_llama():
    gpt2 = flatten_hf_model(hf_model(tiny("gpt2")))
    assert gpt2.tied == [TiedGroup([(0, "wte.weight"), (3, "lm_head.weight")])]
    assert describe_ties(gpt2.tied, gpt2.names) == "embedding.wte.weight = head.lm_head.weight"
    assert gpt2.tied[0].spans_layers and gpt2.tied[0].layer_indices == [0, 3]

    tied = flatten_hf_model(hf_model(tiny("llama", tie_embeddings=True)))
    assert describe_ties(tied.tied, tied.names) == "embedding.embed_tokens.weight = head.lm_head.weight"

    untied = flatten_hf_model(hf_model(tiny("llama", tie_embeddings=False)))
    assert untied.tied == [] and describe_ties(untied.tied, untied.names) == "none"


def test_ties_within_a_layer_and_on_meta():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight

    lm = layers_from_modules([Shared(), nn.Linear(4, 4)])
    assert lm.tied == [TiedGroup([(0, "a.weight"), (0, "b.weight")])]
    with torch.device("meta"):
        emb, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    assert find_tied_parameters([emb, None, head]) == [TiedGroup([(0, "weight"), (2, "weight")])]


@pytest.mark.parametrize("family,tie", [("gpt2", True), ("llama", True), ("qwen2", False)])
def test_declared_ties_agree_with_detection(family, tie):
    lm = build_layer_model(tiny(family, tie_embeddings=tie), seed=1)
    assert lm.tied == find_tied_parameters(lm.layers)
    assert bool(lm.tied) == tie
    part = build_layer_model(tiny(family, tie_embeddings=tie), seed=1, owned=[3])
    assert part.tied == lm.tied  # declared even when layer 0 is elsewhere


# --------------------------------------------------------------------- per-layer determinism


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_per_layer_init_is_independent_of_the_split(family):
    cfg = tiny(family, num_layers=4, tie_embeddings=True)
    full = build_layer_model(cfg, seed=7)
    first = build_layer_model(cfg, seed=7, owned={0, 1, 2})
    second = build_layer_model(cfg, seed=7, owned={3, 4, 5})
    assert full.num_layers == 6 and first.built == [0, 1, 2] and second.built == [3, 4, 5]
    for i in range(6):
        part = first if i < 3 else second
        a, b = state(full.layers[i]), state(part.layers[i])
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (i, k)
    emb_name = "wte.weight" if family == "gpt2" else "embed_tokens.weight"
    emb = first.layers[0].get_parameter(emb_name)
    assert torch.equal(second.layers[5].lm_head.weight, emb)  # built apart: equal values
    assert second.layers[5].lm_head.weight is not emb
    assert full.layers[5].lm_head.weight is full.layers[0].get_parameter(emb_name)  # together: shared

    other = build_layer_model(cfg, seed=8, owned={1})
    a, b = state(other.layers[1]), state(full.layers[1])
    assert all(not torch.equal(a[k], b[k]) for k in a if b[k].std() > 0)  # not norms / biases


@pytest.mark.parametrize("family", FAMILIES)
def test_empty_layers_are_allocated_not_drawn(family, monkeypatch):
    """Layers about to be received (`empty`) are allocated with the right shapes and nothing else:
    no numbers drawn from the seed for them; built and empty tied ends share one Parameter, and a
    Rope layer's rotary frequencies are computed (they are never transferred)."""
    import oobleck_elastic.models.build as build

    cfg = tiny(family, num_layers=4, tie_embeddings=True)
    full = build_layer_model(cfg, seed=7)
    drawn = []
    init = build._init_parameters
    monkeypatch.setattr(build, "_init_parameters", lambda layer, **kw: (drawn.append(kw["index"]), init(layer, **kw)))
    part = build_layer_model(cfg, seed=7, owned=[0, 1, 2, 5], empty=[1, 5, 4])
    assert part.built == [0, 1, 2, 5] and sorted(drawn) == [0, 2]
    for i in (1, 5):
        assert {k: v.shape for k, v in state(part.layers[i]).items()} == {
            k: v.shape for k, v in state(full.layers[i]).items()
        }
    emb_name = "wte.weight" if family == "gpt2" else "embed_tokens.weight"
    assert part.layers[5].lm_head.weight is part.layers[0].get_parameter(emb_name)
    if family != "gpt2":
        torch.testing.assert_close(part.layers[1].rotary_emb.inv_freq, full.layers[1].rotary_emb.inv_freq)


def test_init_scheme_and_untied_head():
    lm = build_layer_model(tiny("gpt2", num_layers=4), seed=0)
    block = lm.layers[1].block
    assert torch.equal(block.ln_1.weight, torch.ones(32)) and torch.equal(block.attn.c_attn.bias, torch.zeros(96))
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.003
    assert abs(block.mlp.c_proj.weight.std().item() - 0.02 / 8**0.5) < 0.002
    untied = build_layer_model(tiny("llama", tie_embeddings=False), seed=0)
    assert not torch.equal(untied.layers[-1].lm_head.weight, untied.layers[0].embed_tokens.weight)
    rng = torch.get_rng_state()
    build_layer_model(tiny("llama"), seed=0)
    assert torch.equal(rng, torch.get_rng_state())  # the global RNG is not consumed


def test_stage_and_missing_layers():
    cfg = tiny("gpt2")
    full = build_layer_model(cfg, seed=0)
    x = ids()
    with torch.no_grad():
        assert torch.equal(full.stage(2, 4)(full.stage(0, 2)(x)), full.forward(x))
    part = build_layer_model(cfg, seed=0, owned=[0, 1])
    assert part.layers[2] is None and part.layers[3] is None
    with pytest.raises(RuntimeError, match="not built"):
        part.stage(1, 3)
    with pytest.raises(RuntimeError, match="not built"):
        part.forward(x)
    with pytest.raises(ValueError, match="out of range"):
        build_layer_model(cfg, seed=0, owned=[9])
    loss = full.loss_fn(full.forward(x), x)
    assert loss.ndim == 0 and loss.item() > 0


# --------------------------------------------------------------------- hf names


@pytest.mark.parametrize(
    "family,tie", [("gpt2", True), ("llama", False), ("llama", True), ("mistral", False), ("qwen2", False)]
)
def test_hf_names_load_into_hf_model(family, tie):
    cfg = tiny(family, tie_embeddings=tie)
    lm = build_layer_model(cfg, seed=11)
    if family == "gpt2":
        assert lm.hf_names[0]["wte.weight"] == "transformer.wte.weight"
        assert lm.hf_names[1]["block.ln_1.weight"] == "transformer.h.0.ln_1.weight"
        assert lm.hf_names[3]["norm.weight"] == "transformer.ln_f.weight"
    else:
        assert lm.hf_names[0]["embed_tokens.weight"] == "model.embed_tokens.weight"
        assert lm.hf_names[2]["layer.self_attn.q_proj.weight"] == "model.layers.1.self_attn.q_proj.weight"
        assert lm.hf_names[3]["norm.weight"] == "model.norm.weight"
    assert lm.hf_names[3]["lm_head.weight"] == "lm_head.weight"
    model = hf_model(cfg, seed=99)
    sd = {
        lm.hf_names[i][k]: p.detach()
        for i, layer in enumerate(lm.layers)
        for k, p in layer.named_parameters(remove_duplicate=False)
    }
    assert set(sd) == set(model.state_dict())
    model.load_state_dict(sd)
    x = ids()
    with torch.no_grad():
        assert torch.equal(model(x).logits, lm.forward(x))
    # names are known for layers this process does not build
    assert build_layer_model(cfg, seed=11, owned=[0]).hf_names == lm.hf_names


# --------------------------------------------------------------------- custom factory


FACTORY = """
import torch
from torch import nn

def linears(cfg):
    return [nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(3)]

def builders(cfg):
    return [lambda: nn.Linear(4, 4) for _ in range(3)]

def not_a_list(cfg):
    return 42

def bad_builder(cfg):
    return [lambda: "nope"]
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    (tmp_path / "oobleck_test_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "oobleck_test_factory"


def test_custom_factory(factory_module):
    cfg = tiny(family="custom", hidden_size=8, custom_factory=f"{factory_module}:linears")
    full = build_layer_model(cfg, seed=5)
    assert isinstance(full, LayerModel) and full.names == ["layer.0", "layer.1", "layer.2"]
    assert full.hf_names[1] == {"weight": "layer.1.weight", "bias": "layer.1.bias"}
    assert full.forward(torch.ones(2, 8)).shape == (2, 8)
    part = build_layer_model(cfg, seed=5, owned=[2])
    assert part.built == [2] and torch.equal(part.layers[2].weight, full.layers[2].weight)
    assert not torch.equal(build_layer_model(cfg, seed=6).layers[0].weight, full.layers[0].weight)

    lazy = tiny(family="custom", custom_factory=f"{factory_module}:builders")
    a = build_layer_model(lazy, seed=5, owned=[1])
    b = build_layer_model(lazy, seed=5)
    assert a.layers[0] is None and torch.equal(a.layers[1].weight, b.layers[1].weight)
    assert not torch.equal(b.layers[0].weight, b.layers[1].weight)


@pytest.mark.parametrize(
    "spec,err,match",
    [
        ("{m}:not_a_list", TypeError, "must return a non-empty list of nn.Module"),
        ("{m}:bad_builder", TypeError, "returned str"),
        ("{m}:missing", ValueError, "has no function 'missing'"),
        ("no_such_module_xyz:f", ValueError, "cannot import"),
        ("nocolon", ValueError, "package.module:function"),
    ],
)
def test_bad_custom_factory(factory_module, spec, err, match):
    cfg = tiny(family="custom", custom_factory=spec.format(m=factory_module))
    with pytest.raises(err, match=match):
        build_layer_model(cfg, seed=0)


# --------------------------------------------------------------------- pretrained


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_pretrained_path(tmp_path, family):
    cfg = tiny(family, tie_embeddings=family == "gpt2")
    model = hf_model(cfg, seed=4)
    model.save_pretrained(tmp_path / "m")
    cfg.pretrained_path = str(tmp_path / "m")
    lm = build_layer_model(cfg, seed=0)
    x = ids()
    with torch.no_grad():
        assert (lm.forward(x) - model(x).logits).abs().max().item() == 0.0
    part = build_layer_model(cfg, seed=0, owned=[2, 3])
    assert part.layers[0] is None and part.tied == lm.tied
    assert torch.equal(part.layers[3].lm_head.weight, lm.layers[3].lm_head.weight)


def test_pretrained_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_layer_model(tiny(pretrained_path=str(tmp_path / "nope")), seed=0)
    hf_model(tiny("gpt2")).save_pretrained(tmp_path / "g")
    with pytest.raises(ValueError, match="model.family=gpt2"):
        build_layer_model(tiny("llama", pretrained_path=str(tmp_path / "g")), seed=0)
