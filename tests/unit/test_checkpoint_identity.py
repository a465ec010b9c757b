"""A checkpoint belongs to its model: the identity record a checkpoint keeps, the one-line refusal
of another model's checkpoint before any tensor is read (at start, the "nothing to do" check
included, and in a restore), and older checkpoints without a record accepted as before."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from oobleck_elastic import checkpoint as ckpt
from oobleck_elastic.checkpoint import (
    MODEL_KEY,
    describe_model,
    different_model,
    foreign_checkpoint,
    model_record,
    save_layer,
    write_manifest,
)
from oobleck_elastic.config import ConfigError, ModelConfig, load_config, to_dict
from oobleck_elastic.engine.checkpointing import restore
from oobleck_elastic.engine.startup import check_start, foreign_model
from oobleck_elastic.models.identity import model_identity

TINY = "configs/gpt2-tiny.yaml"
WANT = (
    "checkpoint.dir=checkpoints holds a checkpoint of another model (step-00000150: gpt2, 4 layers, hidden 128, "
    "vocab 512; this job: gpt2, 2 layers, hidden 64, vocab 256): set checkpoint.dir to a directory of its own"
)


def made_up_checkpoint(root: Path, step: int, model: ModelConfig | None) -> Path:
    """A one-layer checkpoint written with the package's own writers; its identity record is
    `model`'s (None: a checkpoint from before the record)."""
    entry = save_layer(root, step=step, layer=0, params={"w": torch.zeros(2)}, optimizer_state={})
    extra = {MODEL_KEY: model_identity(model)} if model is not None else {}
    return write_manifest(
        root,
        step=step,
        data_cursor={"step": step},
        plan=None,
        config={},
        layers=[entry],
        layer_names=["embedding"],
        hf_names=[{"w": "w"}],
        extra=extra,
    ).parent


def test_the_refusal_names_the_directory_both_models_and_the_key() -> None:
    theirs = model_identity(ModelConfig(num_layers=4, hidden_size=128, vocab_size=512))
    mine = model_identity(ModelConfig(num_layers=2, hidden_size=64, vocab_size=256))
    assert different_model("checkpoints", "step-00000150", theirs, mine) == WANT
    assert different_model("checkpoints", "step-00000150", mine, mine) is None
    assert different_model("checkpoints", "step-00000150", None, mine) is None  # before the record: accepted
    # what the four always-named keys do not show is named when it is all that differs
    heads = model_identity(ModelConfig(num_heads=2))
    assert different_model("ck", "step-00000002", heads, model_identity(ModelConfig())) == (
        "checkpoint.dir=ck holds a checkpoint of another model (step-00000002: gpt2, 4 layers, hidden 64, vocab 256, "
        "2 heads, 2 key/value heads; this job: gpt2, 4 layers, hidden 64, vocab 256, 4 heads, 4 key/value heads): "
        "set checkpoint.dir to a directory of its own"
    )
    llama = model_identity(ModelConfig(family="llama", num_kv_heads=2))
    assert describe_model(llama) == "llama, 4 layers, hidden 64, vocab 256" and "positions" not in llama
    assert different_model("ck", "s", llama, model_identity(ModelConfig())) is not None  # family
    # settings that change no tensor's shape are the same model
    same = ModelConfig(dropout=0.1, attn_implementation="eager", pad_vocab_to=128)
    assert model_identity(same) == model_identity(ModelConfig())
    custom = model_identity(ModelConfig(family="custom", custom_factory="m:f"))
    assert custom == {"family": "custom", "factory": "m:f"} and describe_model(custom) == "custom"


def test_the_newest_checkpoint_of_a_directory_is_judged_by_its_record(tmp_path: Path) -> None:
    mine = model_identity(ModelConfig())
    assert foreign_checkpoint(tmp_path / "none", mine) is None
    made_up_checkpoint(tmp_path, 2, ModelConfig())
    assert foreign_checkpoint(tmp_path, mine) is None
    sdir = made_up_checkpoint(tmp_path, 4, ModelConfig(hidden_size=128))
    assert model_record(ckpt.read_manifest(sdir)) == model_identity(ModelConfig(hidden_size=128))
    assert foreign_checkpoint(tmp_path, mine) == (
        f"checkpoint.dir={tmp_path} holds a checkpoint of another model (step-00000004: gpt2, 4 layers, hidden 128, "
        "vocab 256; this job: gpt2, 4 layers, hidden 64, vocab 256): set checkpoint.dir to a directory of its own"
    )
    (tmp_path / "step-00000006").mkdir()  # an interrupted save is no checkpoint to judge
    assert foreign_checkpoint(tmp_path, mine) is not None
    made_up_checkpoint(tmp_path, 8, None)  # the newest is from before the record
    assert foreign_checkpoint(tmp_path, mine) is None


def test_a_start_refuses_another_models_checkpoint_before_nothing_to_do(tmp_path: Path) -> None:
    """At training.steps already reached, the refusal comes first: "nothing to do" would speak
    of another model's checkpoint. Without a record (an older checkpoint), as before."""
    ck = tmp_path / "ck"
    made_up_checkpoint(ck, 20, ModelConfig(hidden_size=128, vocab_size=4096, max_seq_len=128))
    cfg = load_config(TINY, [f"checkpoint.dir={ck}", "model.num_layers=2"])
    want = (
        f"checkpoint.dir={ck} holds a checkpoint of another model (step-00000020: gpt2, 4 layers, hidden 128, "
        "vocab 4096; this job: gpt2, 2 layers, hidden 64, vocab 256): set checkpoint.dir to a directory of its own"
    )
    assert foreign_model(cfg) == want
    for steps in (20, 200):
        with pytest.raises(ConfigError) as err:
            check_start(load_config(TINY, [f"checkpoint.dir={ck}", "model.num_layers=2", f"training.steps={steps}"]))
        assert str(err.value) == want
    check_start(load_config(TINY, [f"checkpoint.dir={ck}", "checkpoint.resume=false"]))  # not resuming: no look
    own = tmp_path / "own"
    made_up_checkpoint(own, 20, load_config(TINY).model)
    with pytest.raises(ConfigError, match="^nothing to do: checkpoint step-00000020"):
        check_start(load_config(TINY, [f"checkpoint.dir={own}"]))
    older = tmp_path / "older"
    made_up_checkpoint(older, 20, None)
    with pytest.raises(ConfigError, match="^nothing to do: checkpoint step-00000020"):
        check_start(load_config(TINY, [f"checkpoint.dir={older}"]))
    check_start(load_config(TINY, [f"checkpoint.dir={older}", "training.steps=21"]))  # resumes as before
    missing = load_config(TINY, [f"checkpoint.dir={ck}", f"model.pretrained_path={tmp_path / 'nowhere'}"])
    assert foreign_model(missing) is None  # the build names the missing directory


def test_a_restore_refuses_another_models_checkpoint_before_reading_a_file(tmp_path: Path, monkeypatch) -> None:
    sdir = made_up_checkpoint(tmp_path, 4, ModelConfig(hidden_size=128))

    def no_load(*args, **kwargs):
        raise AssertionError("a layer file was read")

    monkeypatch.setattr(ckpt, "load_layer", no_load)
    trainer = SimpleNamespace(cfg=load_config(TINY), layer_model=SimpleNamespace(num_layers=6))
    with pytest.raises(ckpt.CheckpointError) as err:
        restore(trainer, sdir)  # type: ignore[arg-type]
    assert str(err.value) == (
        f"checkpoint.dir={tmp_path} holds a checkpoint of another model (step-00000004: gpt2, 4 layers, hidden 128, "
        "vocab 256; this job: gpt2, 4 layers, hidden 64, vocab 256): set checkpoint.dir to a directory of its own"
    )
    assert to_dict(trainer.cfg)["checkpoint"]["dir"] == "checkpoints/gpt2-tiny"
