"""Per-layer safetensors checkpoints: exact round trip of params and AdamW state, the latest
complete checkpoint, corruption detection naming the file, and Hugging Face state dicts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from oobleck_elastic.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_layer,
    load_model_state,
    prune_checkpoints,
    read_manifest,
    save_layer,
    write_manifest,
)
from oobleck_elastic.config import load_config, to_dict
from oobleck_elastic.models import build_layer_model, hf_config

JOB = load_config("configs/gpt2-tiny.yaml")


def trained_model():
    lm = build_layer_model(JOB.model, seed=3)
    params = list({id(p): p for layer in lm.layers for p in layer.parameters()}.values())
    opt = torch.optim.AdamW(params, lr=1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    lm.loss_fn(lm(ids), torch.roll(ids, -1, 1)).backward()
    opt.step()
    return lm, opt


def save_all(lm, opt, root: Path, step: int) -> Path:
    entries = []
    for i, layer in enumerate(lm.layers):
        named = dict(layer.named_parameters())
        entries.append(
            save_layer(
                root, step=step, layer=i, params=named, optimizer_state={n: opt.state[p] for n, p in named.items()}
            )
        )
    return write_manifest(
        root,
        step=step,
        data_cursor={"step": step},
        plan=None,
        config=to_dict(JOB),
        layers=entries,
        layer_names=lm.names,
        hf_names=lm.hf_names,
        extra={"note": "test"},
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    lm, opt = trained_model()
    manifest = save_all(lm, opt, root, step=4)
    return root, lm, opt, manifest


def test_round_trip_bit_equal(saved):
    root, lm, opt, manifest = saved
    sdir = manifest.parent
    assert sdir.name == "step-00000004" and manifest.name == "manifest.json"
    assert sorted(p.name for p in sdir.iterdir()) == [
        "layer-000.safetensors",
        "layer-001.safetensors",
        "layer-002.safetensors",
        "layer-003.safetensors",
        "layer-004.safetensors",
        "layer-005.safetensors",
        "manifest.json",
    ]  # no temp files left
    m = read_manifest(sdir)
    assert m["schema_version"] == 1 and m["step"] == 4 and m["data_cursor"] == {"step": 4}
    assert m["layer_names"] == lm.names and m["extra"] == {"note": "test"}
    for i, layer in enumerate(lm.layers):
        params, optim = load_layer(sdir, i)
        named = dict(layer.named_parameters())
        assert params.keys() == named.keys() and optim.keys() == named.keys()
        for name, p in named.items():
            assert params[name].dtype == p.dtype and torch.equal(params[name], p.detach())
            want = opt.state[p]
            assert optim[name].keys() == want.keys() == {"step", "exp_avg", "exp_avg_sq"}
            for key, value in want.items():
                assert torch.equal(optim[name][key], value), (i, name, key)


def test_python_scalar_optimizer_state(tmp_path):
    w = torch.randn(3, 2).t()  # non-contiguous
    entry = save_layer(
        tmp_path,
        step=1,
        layer=0,
        params={"w": w, "v": w},  # shared storage
        optimizer_state={"w": {"step": 5, "lr": 0.5, "m": torch.ones(2)}},
    )
    write_manifest(
        tmp_path,
        step=1,
        data_cursor={},
        plan=None,
        config={},
        layers=[entry],
        layer_names=["l"],
        hf_names=[{"w": "w", "v": "v"}],
    )
    params, optim = load_layer(tmp_path / "step-00000001", 0)
    assert torch.equal(params["w"], w) and torch.equal(params["v"], w)
    assert optim["w"]["step"] == 5 and isinstance(optim["w"]["step"], int)
    assert optim["w"]["lr"] == 0.5 and torch.equal(optim["w"]["m"], torch.ones(2))


def test_latest_ignores_incomplete(tmp_path):
    assert latest_checkpoint(tmp_path / "none") is None
    lm, opt = trained_model()
    save_all(lm, opt, tmp_path, step=2)
    save_all(lm, opt, tmp_path, step=10)
    layer = dict(lm.layers[0].named_parameters())
    save_layer(tmp_path, step=12, layer=0, params=layer, optimizer_state={})  # no manifest
    (tmp_path / "step-00000011").mkdir()
    (tmp_path / "step-00000011" / "manifest.json").write_text("{not json")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000010"
    with pytest.raises(CheckpointError, match=r"step-00000011/manifest.json is malformed"):
        read_manifest(tmp_path / "step-00000011")
    with pytest.raises(CheckpointError, match="does not exist: the checkpoint is incomplete"):
        read_manifest(tmp_path / "step-00000012")
    removed = prune_checkpoints(tmp_path, 1)[0].removed
    assert sorted(p.name for p in removed) == ["step-00000002"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-00000010"
    assert (tmp_path / "step-00000012").is_dir()  # newer: may still be being written


def copy_checkpoint(saved, tmp_path) -> Path:
    import shutil

    root, *_ = saved
    dst = tmp_path / "step-00000004"
    shutil.copytree(root / "step-00000004", dst)
    return dst


def test_corrupt_file_named(saved, tmp_path):
    sdir = copy_checkpoint(saved, tmp_path)
    f = sdir / "layer-002.safetensors"
    blob = bytearray(f.read_bytes())
    blob[-10] ^= 0xFF
    f.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError) as err:
        load_layer(sdir, 2)
    assert str(err.value).startswith(f"checkpoint file {f} is corrupt: sha256 mismatch")
    assert "delete step-00000004 to fall back" in str(err.value)
    load_layer(sdir, 1)  # the others still load


def test_truncated_and_missing_file_named(saved, tmp_path):
    sdir = copy_checkpoint(saved, tmp_path)
    f = sdir / "layer-001.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as err:
        load_layer(sdir, 1)
    assert str(err.value).startswith(f"checkpoint file {f} is corrupt: truncated")
    with pytest.raises(CheckpointError, match="is corrupt"):
        load_layer(sdir, 1, verify=False)  # safetensors itself refuses the truncated header/data
    (sdir / "layer-003.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        load_layer(sdir, 3)
    assert str(err.value).startswith(f"checkpoint file {sdir / 'layer-003.safetensors'} is missing")


def test_hf_state_dict_loads_and_matches_logits(saved):
    root, lm, _, manifest = saved
    for where in (root, manifest.parent):
        state = load_model_state(where)
        assert torch.equal(state["transformer.wte.weight"], state["lm_head.weight"])
        model = transformers.GPT2LMHeadModel(hf_config(JOB.model)).eval()
        result = model.load_state_dict(state, strict=False)
        assert not result.unexpected_keys
        param_names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        assert not param_names.intersection(result.missing_keys)
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, lm(ids), rtol=0, atol=1e-5)


def test_resume_picks_the_newest_checkpoint_whose_every_file_verifies(tmp_path: Path) -> None:
    from helpers import flip_byte
    from oobleck_elastic.checkpoint import newest_intact_checkpoint, set_aside, verify_checkpoint

    lm, opt = trained_model()
    for step in (2, 4, 6, 8):
        save_all(lm, opt, tmp_path, step=step)
    (tmp_path / "step-00000010").mkdir()  # an interrupted save: no manifest
    layer = tmp_path / "step-00000008" / "layer-002.safetensors"  # one flipped byte
    flip_byte(layer)
    (tmp_path / "step-00000006" / "manifest.json").write_text('{"schema_version": 1, "st')  # truncated
    assert verify_checkpoint(tmp_path / "step-00000004")["step"] == 4
    with pytest.raises(CheckpointError, match="layer-002.safetensors is corrupt: sha256 mismatch"):
        verify_checkpoint(tmp_path / "step-00000008")
    path, unusable = newest_intact_checkpoint(tmp_path)
    assert path == tmp_path / "step-00000004"
    assert [(u.path.name, u.damaged) for u in unusable] == [
        ("step-00000010", False),
        ("step-00000008", True),
        ("step-00000006", True),
    ]
    assert "layer-002.safetensors" in unusable[1].reason and "manifest" in unusable[2].reason
    moved = set_aside(tmp_path / "step-00000008", "corrupt")
    assert moved is not None and moved.name.startswith("step-00000008.corrupt-") and (moved / layer.name).exists()
    assert set_aside(tmp_path / "step-00000008", "corrupt") is None  # another worker was first
    assert newest_intact_checkpoint(tmp_path)[0] == tmp_path / "step-00000004"  # set-aside dirs are not listed
    assert newest_intact_checkpoint(tmp_path / "nothing") == (None, [])
