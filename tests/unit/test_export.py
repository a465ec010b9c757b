"""`oobleck export`: a checkpoint written as the project writes it becomes a sharded Hugging Face
directory that transformers loads with the same logits, and that loads back through the per-layer
pretrained reader bit for bit; ties written once; exact errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from oobleck_elastic.checkpoint import save_layer, write_manifest
from oobleck_elastic.cli import main
from oobleck_elastic.config import ModelConfig, load_config, to_dict
from oobleck_elastic.models import build_layer_model
from oobleck_elastic.models.export import export_checkpoint, parse_size

SEQ = 16
EOT = "<|endoftext|>"
SHARD = 20_000  # bytes: the tiny models below need several shards


def job(family: str, **model):
    base = dict(
        family=family,
        vocab_size=256,  # data.tokenizer=bytes (the default): its tokenizer is exported
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=None if family == "gpt2" else 2,
        intermediate_size=64,
        max_seq_len=SEQ,
        tie_embeddings=family == "gpt2",
    )
    base.update(model)
    return load_config(
        None, [f"model.{k}={'null' if v is None else v}" for k, v in base.items()] + [f"data.seq_len={SEQ}"]
    )


def ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(0))


def write_checkpoint(cfg, root: Path, step: int = 1):
    """One AdamW step on a build_layer_model model, saved as engine/checkpointing.py saves it."""
    lm = build_layer_model(cfg.model, seed=5)
    params = list({id(p): p for layer in lm.layers for p in layer.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-2)
    lm.loss_fn(lm(ids()), torch.roll(ids(), -1, 1)).backward()
    opt.step()
    entries = []
    for i, layer in enumerate(lm.layers):
        named = dict(layer.named_parameters())
        entries.append(
            save_layer(
                root, step=step, layer=i, params=named, optimizer_state={n: opt.state[p] for n, p in named.items()}
            )
        )
    manifest = write_manifest(
        root,
        step=step,
        data_cursor={"step": step},
        plan=None,
        config=to_dict(cfg),
        layers=entries,
        layer_names=lm.names,
        hf_names=lm.hf_names,
    )
    return lm, manifest.parent


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_export_loads_in_transformers_and_round_trips(tmp_path, family):
    cfg = job(family)
    lm, sdir = write_checkpoint(cfg, tmp_path / "ckpt")
    lines: list[str] = []
    out = export_checkpoint(sdir, tmp_path / "hf", max_shard_bytes=SHARD, log=lines.append)
    assert out == tmp_path / "hf"
    assert len(lines) == 6
    assert lines[4] == "tokenizer: bytes from data.tokenizer=bytes, bos=None eos=None pad=None"
    assert [line.split(":")[0] for line in lines[:4]] == [
        "layer 1/4 embedding",
        "layer 2/4 block.0",
        "layer 3/4 block.1",
        "layer 4/4 head",
    ]
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 2 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert lines[-1].startswith(f"exported step 1 to {out}: {n} shard(s), ")
    assert lines[-1].endswith(f"load it with transformers.AutoModelForCausalLM.from_pretrained('{out}')")
    assert not (out / "model.safetensors").exists() and not list(out.glob(".export-*"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    sizes = {}
    for shard in shards:
        with safe_open(str(out / shard), "pt") as fh:
            assert fh.metadata() == {"format": "pt"}
            for key in fh.keys():
                assert weight_map[key] == shard
                sizes[key] = fh.get_slice(key).get_shape()
    assert sizes.keys() == weight_map.keys()
    names = {v for layer in lm.hf_names for v in layer.values()}
    tied = family == "gpt2"
    assert set(weight_map) == (names - {"lm_head.weight"} if tied else names)  # a tie is written once
    assert index["metadata"]["total_size"] == sum(
        p.numel() * 4 for p in {id(p): p for layer in lm.layers for p in layer.parameters()}.values()
    )
    conf = json.loads((out / "config.json").read_text())
    assert conf["tie_word_embeddings"] is tied and conf["model_type"] == family and conf["use_cache"] is True
    # the byte tokenizer names no special token (training put no separator between documents)
    assert conf["bos_token_id"] is None and conf["eos_token_id"] is None and conf["pad_token_id"] is None
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hé €")["input_ids"] == list("hé €".encode()) and tok.decode(list("hé €".encode())) == "hé €"

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.allclose(model(ids()).logits, lm(ids()), atol=1e-5)

    back = build_layer_model(ModelConfig(family=family, pretrained_path=str(out)), seed=0)
    assert back.hf_names == lm.hf_names and back.tied == lm.tied
    for mine, ref in zip(back.layers, lm.layers):
        a, b = dict(mine.named_parameters()), dict(ref.named_parameters())
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_shard_is_model_safetensors_and_bf16(tmp_path):
    _, sdir = write_checkpoint(job("llama", tie_embeddings=True), tmp_path / "ckpt")
    out = export_checkpoint(sdir, tmp_path / "hf", dtype=torch.bfloat16, log=lambda _: None)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    conf = json.loads((out / "config.json").read_text())
    assert conf["dtype"] == "bfloat16" and conf["tie_word_embeddings"] is True
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert "lm_head.weight" not in fh.keys()
        assert fh.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"


def save_bpe_tokenizer(path: Path, vocab: int) -> Path:
    """A byte-level BPE trained here on a few sentences, saved as a transformers tokenizer
    directory with eos = <|endoftext|>."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    texts = [f"the {w} sat on the mat {i}" for i, w in enumerate(["cat", "dog", "bird", "fish"] * 10)]
    bpe.train_from_iterator(texts, vocab_size=vocab, min_frequency=2, special_tokens=[EOT], show_progress=False)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOT).save_pretrained(str(path))
    return path


def test_a_checkpoint_of_a_pretrained_job_keeps_its_config_json(tmp_path):
    src = tmp_path / "src"
    conf = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        rope_theta=5000.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.LlamaForCausalLM(conf).save_pretrained(src)
    save_bpe_tokenizer(src, 300)
    cfg = load_config(
        None,
        [
            "model.family=llama",
            f"model.pretrained_path={src}",
            f"data.seq_len={SEQ}",
            f"model.max_seq_len={SEQ}",
            "model.pad_vocab_to=1",  # write_checkpoint stores the layers as built (the trainer unpads)
            "data.tokenizer=hf",
            f"data.tokenizer_path={src}",
        ],
    )
    lm, sdir = write_checkpoint(cfg, tmp_path / "ckpt")
    moved = tmp_path / "moved"
    src.rename(moved)
    with pytest.raises(FileNotFoundError) as err:
        export_checkpoint(sdir, tmp_path / "hf", log=lambda _: None)
    assert str(err.value) == (
        f"model.pretrained_path '{src}' does not exist: give a local directory written by "
        "save_pretrained (config.json + *.safetensors); hub downloads are disabled; the "
        "checkpoint was trained from it and its config.json is needed: pass "
        "model.pretrained_path=DIR"
    )
    with pytest.raises(ValueError) as err:
        export_checkpoint(sdir, tmp_path / "hf", overrides=[f"model.pretrained_path={moved}"], log=lambda _: None)
    assert str(err.value) == (
        f"tokenizer '{src}' (data.tokenizer_path) does not exist: pass --tokenizer PATH (a tokenizers JSON file "
        "or a save_pretrained directory) or --tokenizer none"
    )
    assert not (tmp_path / "hf").exists()  # refused before anything is written
    overrides = [f"model.pretrained_path={moved}", f"data.tokenizer_path={moved}"]
    out = export_checkpoint(sdir, tmp_path / "hf", overrides=overrides, log=lambda _: None)
    written = json.loads((out / "config.json").read_text())
    assert written["rope_parameters"]["rope_theta"] == 5000.0 and written["tie_word_embeddings"] is False
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == EOT and written["eos_token_id"] == tok.convert_tokens_to_ids(EOT) == 0
    assert (out / "generation_config.json").read_bytes() == (moved / "generation_config.json").read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.allclose(model(ids()).logits, lm(ids()), atol=1e-5)


def test_cli_takes_the_newest_intact_checkpoint(tmp_path, capsys):
    cfg = job("gpt2")
    root = tmp_path / "ckpt"
    write_checkpoint(cfg, root, step=1)
    lm, sdir = write_checkpoint(cfg, root, step=2)
    (root / "step-00000003").mkdir()  # an interrupted save
    assert main(["export", str(root), str(tmp_path / "hf"), "--max-shard-size", "20KB"]) == 0
    stdout = capsys.readouterr().out.splitlines()
    assert stdout[0] == (
        f"exporting checkpoint step-00000002 (newest intact under {root}; skipped step-00000003 (incomplete))"
    )
    assert len(stdout) == 7 and stdout[-1].startswith(f"exported step 2 to {tmp_path / 'hf'}: ")

    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.allclose(model(ids()).logits, lm(ids()), atol=1e-5)

    # not empty: refused, then --force replaces the model files and keeps the others
    (tmp_path / "hf" / "README.md").write_text("mine")
    capsys.readouterr()  # drop transformers' loading progress
    assert main(["export", str(sdir), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (
        f"oobleck export: error: output directory '{tmp_path / 'hf'}' exists and is "
        "not empty: choose a new directory or pass --force to replace its model "
        "files\n"
    )
    assert main(["export", str(sdir), str(tmp_path / "hf"), "--force"]) == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_cli_errors(tmp_path, capsys):
    assert main(["export", str(tmp_path), str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == (
        f"oobleck export: error: '{tmp_path}' is not a checkpoint: give a step "
        "directory (step-XXXXXXXX with manifest.json) or the directory holding them "
        "(checkpoint.dir)\n"
    )
    assert not (tmp_path / "hf").exists()
    assert main(["export", str(tmp_path), str(tmp_path / "hf"), "--max-shard-size", "lots"]) == 2
    assert capsys.readouterr().err == (
        "oobleck export: error: shard size 'lots' is not a size: give bytes or a "
        "number with KB, MB, GB (or KiB, MiB, GiB), e.g. 5GB\n"
    )
    _, sdir = write_checkpoint(job("gpt2"), tmp_path / "ckpt")
    shutil.copytree(sdir, tmp_path / "bad")
    (tmp_path / "bad" / "layer-002.safetensors").write_bytes(b"broken")
    assert main(["export", str(tmp_path / "bad"), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"oobleck export: error: checkpoint file {tmp_path / 'bad' / 'layer-002.safetensors'} is "
        "corrupt: truncated or resized"
    )
    assert not list((tmp_path / "hf").glob("*.safetensors")) and not list((tmp_path / "hf").glob(".export-*"))


def test_parse_size():
    assert parse_size("20KB") == 20_000 and parse_size("2GiB") == 2 * 2**30 and parse_size("512") == 512
    assert parse_size("5gb") == 5 * 10**9 and parse_size(7) == 7
