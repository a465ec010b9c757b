"""`oobleck export` writes a self-contained directory: the tokenizer the job trained with (copied
into the checkpoint at save time), its bos/eos/pad ids in config.json and generation_config.json;
model.* overrides that contradict the checkpoint's tensors are refused with one line. The round
trip trains a tiny job, exports it, and generates text with the exported model and tokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from oobleck_elastic.cli import main
from oobleck_elastic.config import ModelConfig, load_config
from oobleck_elastic.models.export_checks import checkpoint_values, override_conflict, shape_mismatch
from oobleck_elastic.models.export_tokenizer import (
    SpecialTokens,
    TokenizerSource,
    choose_tokenizer,
    special_tokens,
)

ROOT = Path(__file__).resolve().parents[2]
EOT = "<|endoftext|>"
WORDS = ["cat", "dog", "bird", "fish", "mat", "hat", "tree", "sun"]


def sentences(n: int) -> list[str]:
    return [f"the {WORDS[i % 8]} sat on the {WORDS[(i * 3) % 8]} near the {WORDS[(i * 5) % 8]}." for i in range(n)]


def train_job(tmp: Path, *extra: str):
    """Two steps of a tiny GPT-2 on a small text corpus, checkpointed at the end."""
    from oobleck_elastic.engine.run import train

    corpus = tmp / "corpus"
    corpus.mkdir()
    for k in range(4):
        (corpus / f"doc{k}.txt").write_text("\n".join(sentences(60)[k::4]) + "\n")
    cfg = load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            "training.steps=2",
            "training.global_batch_size=4",
            "training.microbatch_size=2",
            "model.vocab_size=320",
            "model.hidden_size=32",
            "model.num_layers=2",
            "data.seq_len=32",
            "model.max_seq_len=32",
            "data.source=files",
            f"data.paths=[{corpus}]",
            f"data.cache_dir={tmp / 'cache'}",
            f"checkpoint.dir={tmp / 'ckpt'}",
            f"logging.tensorboard_dir={tmp / 'runs'}",
            *extra,
        ],
    )
    assert train(cfg).final_step == 2
    return tmp / "ckpt"


def save_bpe_tokenizer(path: Path, vocab: int) -> Path:
    """A byte-level BPE trained here, saved as a transformers tokenizer directory (eos <|endoftext|>)."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        sentences(200), vocab_size=vocab, min_frequency=2, special_tokens=[EOT], show_progress=False
    )
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token=EOT).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("kind", ["bpe", "hf"])
def test_round_trip_generates_text_with_the_exported_tokenizer(tmp_path, capsys, kind):
    if kind == "bpe":  # the job trains its own BPE with the tokenizers package
        ckpt = train_job(tmp_path, "data.tokenizer=bpe")
        (job_tok,) = (tmp_path / "cache" / "tokenizers").glob("*.json")
        from tokenizers import Tokenizer

        encode = Tokenizer.from_file(str(job_tok)).encode
        reference = lambda text: encode(text, add_special_tokens=False).ids  # noqa: E731
        gone = tmp_path / "cache"
    else:  # a tokenizer trained in the test, given as data.tokenizer_path
        tokdir = save_bpe_tokenizer(tmp_path / "tokdir", 300)
        ckpt = train_job(tmp_path, "data.tokenizer=hf", f"data.tokenizer_path={tokdir}")
        job = transformers.AutoTokenizer.from_pretrained(str(tokdir))
        reference = lambda text: job(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        gone = tokdir
    (step,) = sorted(ckpt.glob("step-*"))
    manifest = json.loads((step / "manifest.json").read_text())
    path = "tokenizer/bpe.json" if kind == "bpe" else "tokenizer"
    assert manifest["extra"]["tokenizer"] == {"kind": kind, "path": path}
    text = "the cat sat on the mat near the dog."
    expected = reference(text)
    shutil.rmtree(gone)  # the export needs only the checkpoint

    capsys.readouterr()
    out = tmp_path / "hf"
    assert main(["export", str(ckpt), str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    eot = tok.convert_tokens_to_ids(EOT)
    origin = f"the job's tokenizer ({kind})"
    bos = eot if kind == "bpe" else None  # the job's BPE: GPT-2's convention; the hf one has no bos_token
    assert f"tokenizer: {kind} from {origin}, bos={bos} eos={eot} pad=None" in lines
    assert tok(text, add_special_tokens=False)["input_ids"] == expected  # the ids the job trained on
    conf = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert tok.eos_token == EOT and conf["eos_token_id"] == gen["eos_token_id"] == eot != 319
    assert conf["bos_token_id"] == bos and conf.get("pad_token_id") is None

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.generation_config.eos_token_id == eot
    prompt = tok("the cat sat", return_tensors="pt")
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=6, do_sample=False, pad_token_id=eot)
    assert generated.shape[1] > prompt["input_ids"].shape[1]
    assert tok.decode(generated[0]).startswith("the cat sat")

    if kind == "bpe":  # a checkpoint saved before checkpoints carried their tokenizer
        del manifest["extra"]["tokenizer"]
        (step / "manifest.json").write_text(json.dumps(manifest))
        capsys.readouterr()  # drop transformers' loading progress
        assert main(["export", str(ckpt), str(tmp_path / "old")]) == 2
        assert capsys.readouterr().err == (
            f"oobleck export: error: checkpoint {step} holds no copy of its data.tokenizer=bpe tokenizer (it was "
            "saved before checkpoints carried one): pass --tokenizer FILE (the job's "
            "<data.cache_dir>/tokenizers/*.json) or --tokenizer none\n"
        )
        assert main(["export", str(ckpt), str(tmp_path / "old"), "--tokenizer", str(step / path)]) == 0
        assert (tmp_path / "old" / "tokenizer.json").read_bytes() == (out / "tokenizer.json").read_bytes()


def test_overrides_that_contradict_the_checkpoint_are_refused(tmp_path, capsys):
    """The report's case: model.vocab_size=5000 over a 320-row checkpoint exited 0 and wrote a
    directory from_pretrained could not load."""
    ckpt = train_job(tmp_path)
    (step,) = sorted(ckpt.glob("step-*"))
    capsys.readouterr()
    cases = {
        "model.vocab_size=5000": "its embedding has 320 rows (model.vocab_size=320)",
        "model.hidden_size=64": "its embedding has 32 columns (model.hidden_size=32)",
        "model.num_layers=3": "it has 4 layers (model.num_layers=2)",
        "model.intermediate_size=64": "its MLP is 128 wide (model.intermediate_size=128)",
        "model.max_seq_len=64": "its position embedding has 32 rows (model.max_seq_len=32)",
    }
    for override, shown in cases.items():
        assert main(["export", str(ckpt), str(tmp_path / "hf"), override]) == 2
        assert capsys.readouterr().err == (
            f"oobleck export: error: override {override} contradicts checkpoint {step}: {shown}; drop the override\n"
        )
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "model.num_heads=2"]) == 2
    assert capsys.readouterr().err == (
        f"oobleck export: error: override model.num_heads=2 contradicts checkpoint {step}: it was trained with "
        "model.num_heads=4; drop the override\n"
    )
    assert not (tmp_path / "hf").exists()
    # overrides that agree, or that the weights do not depend on, are fine
    args = ["model.vocab_size=320", "model.attn_implementation=eager", "model.dropout=0.1", "data.tokenizer=bytes"]
    assert main(["export", str(ckpt), str(tmp_path / "hf"), *args]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.config.vocab_size == 320 and model.config.eos_token_id is None


# --------------------------------------------------------------------- the decisions, on made-up states


def test_checkpoint_values_and_override_conflict():
    names = [
        {"e": "model.embed_tokens.weight"},
        {"k": "model.layers.0.self_attn.k_proj.weight", "g": "model.layers.0.mlp.gate_proj.weight"},
        {},
    ]
    shapes = [{"e": (4096, 64)}, {"k": (32, 64), "g": (176, 64)}, {}]
    values = checkpoint_values(shapes, names, num_heads=4)
    assert {k: v for k, (v, _) in values.items()} == {
        "num_layers": 1,
        "vocab_size": 4096,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_kv_heads": 2,
    }
    recorded = {"family": "llama", "num_heads": 4}
    model = ModelConfig(
        family="llama", vocab_size=4096, hidden_size=64, num_layers=1, num_kv_heads=2, intermediate_size=176
    )
    assert override_conflict(["model.vocab_size=4096", "data.seq_len=9"], model, recorded, values, "D") is None
    kv = ModelConfig(family="llama", vocab_size=4096, hidden_size=64, num_layers=1, intermediate_size=176)
    assert override_conflict(["model.num_kv_heads=null"], kv, recorded, values, "D") == (
        "override model.num_kv_heads=null contradicts checkpoint D: its key projection has 32 rows (2 heads of 16) "
        "(model.num_kv_heads=2); drop the override"
    )
    fam = ModelConfig(
        family="mistral", vocab_size=4096, hidden_size=64, num_layers=1, num_kv_heads=2, intermediate_size=176
    )
    assert override_conflict(["model.family=mistral"], fam, recorded, values, "D") == (
        "override model.family=mistral contradicts checkpoint D: it was trained with model.family=llama; "
        "drop the override"
    )


def test_shape_mismatch_names_the_parameter():
    assert shape_mismatch([{"w": (4, 2)}], [{"w": (4, 2)}], ["embedding"], "D") is None
    assert shape_mismatch([{"w": (4, 2)}], [{"w": (5, 2)}], ["embedding"], "D") == (
        "checkpoint D: parameter 'w' of layer 0 (embedding) has shape [4, 2] but the config gives [5, 2]: export it "
        "with the model config it was trained with"
    )
    assert shape_mismatch([{"w": (4, 2)}], [{"v": (4, 2)}], ["embedding"], "D") == (
        "checkpoint D: layer 0 (embedding) stores parameters ['w'] but the config's layer has ['v'] instead: export "
        "it with the model config it was trained with"
    )


def choose(option=None, record=None, **kw):
    args = dict(
        data_source="stdlib",
        data_tokenizer="bytes",
        tokenizer_path=None,
        pretrained_path=None,
        pretrained_has_tokenizer=False,
        step_dir=Path("/c/step-1"),
    )
    args.update(kw)
    return choose_tokenizer(option, record, **args)


def test_choose_tokenizer():
    copy = {"kind": "bpe", "path": "tokenizer/bpe.json"}
    assert choose(record=copy) == TokenizerSource(
        "bpe", Path("/c/step-1/tokenizer/bpe.json"), "the job's tokenizer (bpe)"
    )
    assert choose("none", copy) == TokenizerSource("none", None, "--tokenizer none")
    assert choose() == TokenizerSource("bytes", None, "data.tokenizer=bytes")
    assert choose(data_tokenizer="hf", tokenizer_path="/t") == TokenizerSource("hf", Path("/t"), "data.tokenizer_path")
    pre = dict(data_source="tokens", pretrained_path="/p")
    assert choose(**pre, pretrained_has_tokenizer=True) == TokenizerSource("hf", Path("/p"), "model.pretrained_path")
    assert choose(**pre) == TokenizerSource("none", None, "data.source=tokens, which records no tokenizer")
    with pytest.raises(ValueError) as err:
        choose(data_tokenizer="bpe")
    assert str(err.value) == (
        "checkpoint /c/step-1 holds no copy of its data.tokenizer=bpe tokenizer (it was saved before checkpoints "
        "carried one): pass --tokenizer FILE (the job's <data.cache_dir>/tokenizers/*.json) or --tokenizer none"
    )
    with pytest.raises(ValueError, match="is not"):
        choose(record={"kind": "bpe", "path": "../../etc/x"})


def test_special_tokens_follow_the_end_of_text_rule(tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(str(save_bpe_tokenizer(tmp_path / "t", 300)))
    eot = tok.convert_tokens_to_ids(EOT)
    assert special_tokens(tok) == SpecialTokens(bos=None, eos=eot, pad=None)
    tok.eos_token = None  # no eos_token: <|endoftext|> is still the end of a document, as in data/
    assert special_tokens(tok) == SpecialTokens(bos=None, eos=eot, pad=None)
    tok.pad_token, tok.bos_token = "a", "b"
    assert special_tokens(tok) == SpecialTokens(
        bos=tok.convert_tokens_to_ids("b"), eos=eot, pad=tok.convert_tokens_to_ids("a")
    )


def test_a_tokenizers_json_given_as_tokenizer_path_goes_into_the_checkpoint_as_a_bpe(tmp_path: Path) -> None:
    """data.tokenizer_path may be a `tokenizers` JSON file (Tokenizer.save): the checkpoint keeps it
    as `bpe.json`, which the export wraps like a job's own BPE."""
    from oobleck_elastic.data.tokenizer import TokenizerFiles, save_tokenizer_files

    source = tmp_path / "tok.json"
    source.write_text('{"version": "1.0"}')
    record = save_tokenizer_files(TokenizerFiles("hf", str(source)), tmp_path / "step-00000001")
    assert record == {"kind": "bpe", "path": "tokenizer/bpe.json"}
    assert (tmp_path / "step-00000001" / "tokenizer" / "bpe.json").read_text() == source.read_text()
