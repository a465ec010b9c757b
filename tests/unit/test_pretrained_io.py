"""Pretrained weights read per layer: bit-equality with Hugging Face's own loading (single file and
sharded, GPT-2 and Llama, tied and untied), only the owned layers' tensors read, one shared
Parameter for a tie built in one process, and one exact line per kind of bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

import oobleck_elastic.models.pretrained as pretrained
from oobleck_elastic.config import ModelConfig
from oobleck_elastic.models import TiedGroup, build_layer_model, flatten_hf_model

SEQ = 16
MODELS = ["gpt2", "llama", "llama-tied"]
LAYOUTS = ["single", "sharded"]


def hf_tiny(name: str) -> torch.nn.Module:
    torch.manual_seed({"gpt2": 1, "llama": 2, "llama-tied": 3}[name])
    if name == "gpt2":
        conf = transformers.GPT2Config(
            vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, bos_token_id=0, eos_token_id=0
        )
        return transformers.GPT2LMHeadModel(conf).eval()
    conf = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=name == "llama-tied",
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.LlamaForCausalLM(conf).eval()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for name in MODELS:
        model = hf_tiny(name)
        model.save_pretrained(root / name / "single")
        model.save_pretrained(root / name / "sharded", max_shard_size="20KB")
        out[name, "single"], out[name, "sharded"] = root / name / "single", root / name / "sharded"
    assert (out["gpt2", "single"] / "model.safetensors").is_file()
    assert len(json.loads((out["gpt2", "sharded"] / "model.safetensors.index.json").read_text())["weight_map"]) > 10
    assert len(list(out["llama", "sharded"].glob("model-*-of-*.safetensors"))) > 3
    return out


def family_of(name: str) -> str:
    return name.split("-")[0]


def cfg_for(path: Path, **kw) -> ModelConfig:
    return ModelConfig(pretrained_path=str(path), **kw)


def ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 128, (batch, SEQ), generator=torch.Generator().manual_seed(0))


def layer_state(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(layer.named_parameters(remove_duplicate=False)) | dict(layer.named_buffers())


# --------------------------------------------------------------------- equality with Hugging Face


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", MODELS)
def test_owned_layers_equal_hf_from_pretrained(dirs, name, layout):
    path = dirs[name, layout]
    ref = flatten_hf_model(transformers.AutoModelForCausalLM.from_pretrained(path).eval())
    cfg = cfg_for(path, family=family_of(name))
    tied = [TiedGroup([(0, "wte.weight" if name == "gpt2" else "embed_tokens.weight"), (3, "lm_head.weight")])]
    for owned in ([0, 1], [2, 3], [1], [3], None):
        lm = build_layer_model(cfg, seed=0, owned=owned)
        assert lm.built == (list(owned) if owned else [0, 1, 2, 3])
        assert lm.names == ref.names and lm.hf_names == ref.hf_names
        assert lm.tied == (tied if name != "llama" else [])
        for i in lm.built:
            mine, theirs = layer_state(lm.layers[i]), layer_state(ref.layers[i])
            assert mine.keys() == theirs.keys(), (owned, i)
            for key, t in theirs.items():
                assert mine[key].dtype == torch.float32 and mine[key].device.type == "cpu"
                assert torch.equal(mine[key], t), (owned, i, key)
            assert all(p.requires_grad for p in lm.layers[i].parameters())
    full = build_layer_model(cfg, seed=0)
    full.stage(0, 4).eval()  # GPT2Config's default dropout is 0.1
    if name != "llama":  # one Parameter for the tie when one process builds both ends
        assert full.layers[3].lm_head.weight is full.layers[0].get_parameter(tied[0].members[0][1])
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        assert (full.forward(ids()) - model(ids()).logits).abs().max().item() == 0.0


def test_tied_groups_match_the_random_init_path(dirs):
    lm = build_layer_model(cfg_for(dirs["gpt2", "single"]), seed=0, owned=[3])
    fresh = build_layer_model(
        ModelConfig(family="gpt2", vocab_size=128, hidden_size=32, num_layers=2, max_seq_len=SEQ), seed=0, owned=[3]
    )
    assert lm.tied == fresh.tied == [TiedGroup([(0, "wte.weight"), (3, "lm_head.weight")])]


def test_checkpoint_without_the_base_model_prefix(dirs, tmp_path):
    # the original GPT-2 files name tensors as the bare GPT2Model does: "h.0.attn...", "wte.weight"
    src = dirs["gpt2", "single"]
    with safe_open(str(src / "model.safetensors"), "pt") as fh:
        tensors = {k.removeprefix("transformer."): fh.get_tensor(k) for k in fh.keys()}
    assert "wte.weight" in tensors and "lm_head.weight" not in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", tmp_path / "config.json")
    mine, ref = build_layer_model(cfg_for(tmp_path), seed=0), build_layer_model(cfg_for(src), seed=0)
    for a, b in zip(mine.layers, ref.layers):
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


# --------------------------------------------------------------------- only the owned tensors are read


class Recorder:
    """Wraps safe_open: records the files opened and every tensor read (name, bytes)."""

    def __init__(self, monkeypatch) -> None:
        self.files: list[str] = []
        self.reads: dict[str, int] = {}
        real = pretrained.safe_open
        recorder = self

        class Handle:
            def __init__(self, path, framework, device="cpu"):
                recorder.files.append(Path(path).name)
                self.inner = real(path, framework=framework, device=device)

            def __enter__(self):
                self.fh = self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.fh.keys()

            def get_tensor(self, key):
                t = self.fh.get_tensor(key)
                recorder.reads[key] = t.numel() * t.element_size()
                return t

        monkeypatch.setattr(pretrained, "safe_open", Handle)

        def no_full_load(*args, **kwargs):
            raise AssertionError("the whole model was loaded")

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_full_load)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_building_one_layer_reads_only_its_tensors(dirs, layout, monkeypatch):
    path = dirs["gpt2", layout]
    index = path / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if layout == "sharded" else None
    rec = Recorder(monkeypatch)
    lm = build_layer_model(cfg_for(path), seed=0, owned=[1])
    block = set(lm.hf_names[1].values())
    assert all(k.startswith("transformer.h.0.") for k in block) and len(block) == 12
    assert set(rec.reads) == block
    assert sum(rec.reads.values()) == sum(p.numel() * 4 for p in lm.layers[1].parameters())
    if weight_map is not None:  # only the shards holding layer 1's tensors are opened, once each
        assert sorted(rec.files) == sorted({weight_map[k] for k in block})
        assert len(rec.files) < len(set(weight_map.values()))
    else:
        assert rec.files == ["model.safetensors"] * 2  # header listing + the reads


def test_a_tied_head_alone_reads_the_embedding(dirs, monkeypatch):
    rec = Recorder(monkeypatch)
    head = build_layer_model(cfg_for(dirs["gpt2", "sharded"]), seed=0, owned=[3])
    assert set(rec.reads) == {"transformer.ln_f.weight", "transformer.ln_f.bias", "transformer.wte.weight"}
    rec.reads.clear()
    emb = build_layer_model(cfg_for(dirs["gpt2", "sharded"]), seed=0, owned=[0])
    assert torch.equal(head.layers[3].lm_head.weight, emb.layers[0].wte.weight)
    both = build_layer_model(cfg_for(dirs["gpt2", "sharded"]), seed=0, owned=[0, 3])
    assert both.layers[3].lm_head.weight is both.layers[0].wte.weight


def test_empty_layers_are_allocated_not_read(dirs, monkeypatch):
    """Layers about to be received (`empty`) are allocated with their shapes, and none of their
    tensors is read; the others are read as usual, and tied ends still share one Parameter."""
    rec = Recorder(monkeypatch)
    lm = build_layer_model(cfg_for(dirs["gpt2", "sharded"]), seed=0, owned=[0, 1, 2, 3], empty=[1, 3])
    assert lm.built == [0, 1, 2, 3]
    assert not any(k.startswith(("transformer.h.0.", "transformer.ln_f.")) for k in rec.reads), sorted(rec.reads)
    assert {k for k in rec.reads if k.startswith("transformer.h.1.")} == set(lm.hf_names[2].values())
    assert all(not p.is_meta for i in (1, 3) for p in lm.layers[i].parameters())
    assert lm.layers[3].lm_head.weight is lm.layers[0].wte.weight


# --------------------------------------------------------------------- bad input: one exact line each


@pytest.mark.parametrize(
    "field,value,hf_key,theirs",
    [
        ("num_layers", 6, "num_hidden_layers", 2),
        ("hidden_size", 48, "hidden_size", 32),
        ("num_heads", 8, "num_attention_heads", 4),
        ("vocab_size", 100, "vocab_size", 128),
        ("num_kv_heads", 4, "num_key_value_heads", 2),
        ("intermediate_size", 96, "intermediate_size", 64),
    ],
)
def test_a_model_field_that_disagrees_with_config_json(dirs, field, value, hf_key, theirs):
    path = dirs["llama", "single"]
    with pytest.raises(ValueError) as err:
        build_layer_model(cfg_for(path, family="llama", **{field: value}), seed=0)
    assert str(err.value) == (
        f"model.pretrained_path '{path}' has {hf_key}={theirs} in config.json but "
        f"model.{field} is {value}: set model.{field}={theirs} or leave it unset"
    )


def test_fields_at_their_defaults_do_not_count(dirs):
    # family (gpt2), num_layers (4), hidden_size (64), vocab_size (256) all at ModelConfig's defaults
    lm = build_layer_model(cfg_for(dirs["llama", "single"]), seed=0, owned=[1])
    assert lm.hf_config.model_type == "llama" and lm.num_layers == 4
    # set to the directory's own values: no disagreement either
    build_layer_model(
        cfg_for(dirs["gpt2", "single"], num_layers=2, hidden_size=32, vocab_size=128, max_seq_len=SEQ),
        seed=0,
        owned=[1],
    )


def test_family_tie_and_length_disagreements(dirs):
    g, t = dirs["gpt2", "single"], dirs["llama-tied", "single"]
    with pytest.raises(ValueError) as err:
        build_layer_model(cfg_for(g, family="llama"), seed=0)
    assert str(err.value) == (
        f"model.pretrained_path '{g}' holds a gpt2 model but model.family is llama: set model.family=gpt2"
    )
    with pytest.raises(ValueError) as err:
        build_layer_model(cfg_for(t, family="llama", tie_embeddings=False), seed=0)
    assert str(err.value) == (
        f"model.pretrained_path '{t}' has tie_word_embeddings=true in config.json but "
        "model.tie_embeddings is false: set model.tie_embeddings=true or leave it unset"
    )
    with pytest.raises(ValueError) as err:
        build_layer_model(cfg_for(g, max_seq_len=128), seed=0)
    assert str(err.value) == (
        f"model.pretrained_path '{g}' has n_positions=16 in config.json (GPT-2's longest "
        "sequence) but model.max_seq_len is 128: set model.max_seq_len (and data.seq_len) "
        "to at most 16"
    )


def test_unsupported_family(tmp_path):
    transformers.GPTNeoXConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, vocab_size=128
    ).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as err:
        build_layer_model(cfg_for(tmp_path), seed=0)
    assert str(err.value) == (
        f"model.pretrained_path '{tmp_path}' holds a gpt_neox model; flat layers exist "
        "for gpt2, llama, mistral, qwen2 (use model.family=custom for others)"
    )


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_weights_shard_and_tensor(dirs, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(dirs["gpt2", "single"] / "config.json", bare / "config.json")
    with pytest.raises(FileNotFoundError) as err:
        build_layer_model(cfg_for(bare), seed=0)
    assert str(err.value) == (
        f"model.pretrained_path '{bare}' has neither model.safetensors nor "
        "model.safetensors.index.json: save the model with save_pretrained "
        "(safetensors; pytorch_model.bin is not read)"
    )

    sharded = copy_of(dirs["gpt2", "sharded"], tmp_path / "sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    first = "transformer.h.0.ln_1.weight"  # layer 1's first parameter
    shard = index["weight_map"][first]
    (sharded / shard).unlink()
    with pytest.raises(FileNotFoundError) as err:
        build_layer_model(cfg_for(sharded), seed=0, owned=[1])
    assert str(err.value) == (
        f"model.pretrained_path '{sharded}': shard {shard} does not exist "
        f"(model.safetensors.index.json lists '{first}' in it): copy the complete directory"
    )

    listed = copy_of(dirs["llama", "sharded"], tmp_path / "listed")
    path = listed / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    path.write_text(json.dumps(index))
    build_layer_model(cfg_for(listed, family="llama"), seed=0, owned=[0, 1, 3])  # layer 2 not needed
    with pytest.raises(ValueError) as err:
        build_layer_model(cfg_for(listed, family="llama"), seed=0, owned=[2])
    assert str(err.value) == (
        f"model.pretrained_path '{listed}': tensor 'model.layers.1.mlp.up_proj.weight' is "
        "not in model.safetensors.index.json: the directory does not hold this model's "
        "weights; rewrite it with save_pretrained"
    )

    single = copy_of(dirs["llama", "single"], tmp_path / "single")
    with safe_open(str(single / "model.safetensors"), "pt") as fh:
        tensors = {k: fh.get_tensor(k) for k in fh.keys() if k != "model.norm.weight"}
    save_file(tensors, str(single / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        build_layer_model(cfg_for(single, family="llama"), seed=0, owned=[3])
    assert str(err.value) == (
        f"model.pretrained_path '{single}': tensor 'model.norm.weight' is not in "
        "model.safetensors: the directory does not hold this model's weights; rewrite it "
        "with save_pretrained"
    )


def test_weights_that_do_not_match_config_json(dirs, tmp_path):
    path = copy_of(dirs["gpt2", "single"], tmp_path / "m")
    conf = json.loads((path / "config.json").read_text())
    conf["vocab_size"] = 100
    (path / "config.json").write_text(json.dumps(conf))
    build_layer_model(cfg_for(path), seed=0, owned=[1])  # the blocks still fit
    with pytest.raises(ValueError) as err:
        build_layer_model(cfg_for(path), seed=0, owned=[0])
    assert str(err.value) == (
        f"model.pretrained_path '{path}': tensor 'transformer.wte.weight' in "
        "model.safetensors has shape [128, 32] but config.json implies [100, 32]: the weights "
        "do not belong to this config.json"
    )
