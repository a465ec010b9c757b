"""Per-layer profiler: positive times, exact byte counts, caching by key, profile_path."""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from oobleck_elastic.config import JobConfig, ModelConfig
from oobleck_elastic.models import build_layer_model
from oobleck_elastic.planning.profile import layer_meter, cache as profile_cache
from oobleck_elastic.planning.profile.profile import LayerProfile, ModelProfile, profile_cache_key
from oobleck_elastic.planning.profile.cache import load_or_profile, profile_key
from oobleck_elastic.planning.profile.profiler import profile_layers

B, L, H, V = 2, 16, 32, 256


def job(tmp_path, **model_kw) -> JobConfig:
    cfg = JobConfig()
    cfg.model = ModelConfig(
        family="gpt2", vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, max_seq_len=L, **model_kw
    )
    cfg.data.seq_len = L
    cfg.data.cache_dir = str(tmp_path / "cache")
    cfg.training.microbatch_size = B
    cfg.planning.profile_warmup = 1
    cfg.planning.profile_repeats = 2
    return cfg


def true_param_bytes(layer: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def test_profile_layers_gpt2():
    lm = build_layer_model(ModelConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, max_seq_len=L), seed=0)
    ids = torch.randint(0, V, (B, L))
    lines: list[str] = []
    prof = profile_layers(
        lm.layers, ids, ids, lm.loss_fn, warmup=1, repeats=3, names=lm.names, key={"k": 1}, log=lines.append
    )
    assert prof.num_layers == 4
    assert [p.name for p in prof.layers] == ["embedding", "block.0", "block.1", "head"]
    assert prof.key == {"k": 1}
    per_layer = [line for line in lines if line.startswith("profiling layer ")]  # not the progress lines
    assert per_layer[2].startswith("profiling layer 3/4 block.1")
    for layer, p in zip(lm.layers, prof.layers):
        assert p.forward_s > 0 and p.backward_s > 0
        assert p.param_bytes == true_param_bytes(layer)  # tied wte counted in both layers
        assert p.grad_bytes == p.param_bytes and p.optimizer_bytes == 2 * p.param_bytes
    assert prof.layers[3].param_bytes == (V * H + 2 * H) * 4
    for p in prof.layers[1:3]:
        assert p.activation_bytes > 4 * B * L * H  # at least a few hidden-sized tensors
        assert p.output_bytes == B * L * H * 4
    assert prof.layers[3].output_bytes == B * L * V * 4
    assert prof.layers[3].activation_bytes >= B * L * V * 4  # CE keeps (log-)softmax of logits
    sgd = profile_layers(lm.layers, ids, ids, lm.loss_fn, warmup=0, repeats=1, optimizer="sgd")
    assert all(p.optimizer_bytes == 0 for p in sgd.layers)
    assert sgd.layers[0].name == "layer.0"


def test_activation_bytes_exclude_parameters():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)]
    x = torch.randn(2, 4, 8)
    prof = profile_layers(layers, x, torch.zeros(2, 4, 8), nn.functional.mse_loss, repeats=1)
    assert prof.layers[0].activation_bytes == 2 * 4 * 8 * 4  # only the input, not the weight
    assert prof.layers[0].param_bytes == 8 * 8 * 4
    with pytest.raises(ValueError, match="every layer built"):
        profile_layers([layers[0], None], x, x, nn.functional.mse_loss)


def test_load_or_profile_caches_by_key(tmp_path, monkeypatch):
    cfg = job(tmp_path)
    lines: list[str] = []
    first = load_or_profile(cfg, log=lines.append)
    key = profile_key(cfg, device="cpu")
    path = tmp_path / "cache" / "profiles" / f"{profile_cache_key(key)}.json"
    assert path.is_file() and first.key == key and first.num_layers == 4
    assert any(line.startswith("profiling layer 2/4 block.0") for line in lines)

    def boom(*a, **k):
        raise AssertionError("re-profiled")

    monkeypatch.setattr(profile_cache, "profile_model", boom)
    lines.clear()
    again = load_or_profile(cfg, log=lines.append)
    assert again.layers == first.layers and "reusing" in lines[0]

    # a different shape is a different key and a different file
    cfg2 = job(tmp_path)
    cfg2.data.seq_len = 8
    assert profile_cache_key(profile_key(cfg2, device="cpu")) != profile_cache_key(key)
    with pytest.raises(AssertionError, match="re-profiled"):
        load_or_profile(cfg2, log=lines.append)


def test_stale_cache_is_reprofiled(tmp_path, monkeypatch):
    cfg = job(tmp_path)
    key = profile_key(cfg, device="cpu")
    path = tmp_path / "cache" / "profiles" / f"{profile_cache_key(key)}.json"
    stale = ModelProfile([LayerProfile("x", 1.0, 1.0, 1, 1, 1, 1)] * 4, key={**key, "torch": "0.1"})
    stale.save(path)
    lines: list[str] = []
    prof = load_or_profile(cfg, log=lines.append)
    assert any("stale" in line and "torch" in line for line in lines)
    assert prof.key == key and prof.layers[0].name == "embedding"
    assert json.loads(path.read_text())["key"] == key  # replaced


def test_profile_path_is_used(tmp_path, monkeypatch):
    cfg = job(tmp_path, tie_embeddings=True)
    given = ModelProfile([LayerProfile(f"l{i}", 0.1, 0.2, 10, 10, 20, 5) for i in range(4)], key={"source": "file"})
    given.save(tmp_path / "p.json")
    cfg.planning.profile_path = str(tmp_path / "p.json")
    monkeypatch.setattr(profile_cache, "profile_model", lambda *a, **k: pytest.fail("profiled"))
    lines: list[str] = []
    prof = load_or_profile(cfg, log=lines.append)
    assert prof.layers == given.layers and prof.key == {"source": "file"}
    assert not (tmp_path / "cache").exists()


def test_profile_key_contents():
    cfg = JobConfig()
    key = profile_key(cfg, device="cpu")
    assert key["model"]["hidden_size"] == cfg.model.hidden_size
    assert key["microbatch_size"] == cfg.training.microbatch_size
    assert key["seq_len"] == cfg.data.seq_len and key["dtype"] == "float32"
    assert key["device"] == "cpu" and key["torch"] == torch.__version__
    assert key["backward_split"] == "stage_backward_input+weight"  # caches without the split are stale
    assert json.loads(json.dumps(key)) == key


def test_a_profile_with_identical_blocks_measured_once_is_never_taken_for_a_full_one(tmp_path, monkeypatch):
    cfg = job(tmp_path)
    assert cfg.planning.profile_identical_blocks_once  # the default
    once = load_or_profile(cfg, log=lambda _: None)
    assert once.key["identical_blocks_once"] is True
    cfg.planning.profile_identical_blocks_once = False
    key = profile_key(cfg, device="cpu")
    assert key["identical_blocks_once"] is False and profile_cache_key(key) != profile_cache_key(once.key)
    lines: list[str] = []
    full = load_or_profile(cfg, log=lines.append)  # measured, not the cached profile
    assert full.key == key and not any("reusing" in line or "identical to" in line for line in lines)
    assert sum(line.startswith("profiling layer") for line in lines) == 4


def test_a_cached_profile_is_reused_with_its_age_and_measured_again_on_request(tmp_path, monkeypatch):
    cfg = job(tmp_path)
    load_or_profile(cfg, log=lambda _: None)
    path = tmp_path / "cache" / "profiles" / f"{profile_cache_key(profile_key(cfg, device='cpu'))}.json"
    mtime = path.stat().st_mtime
    calls: list[int] = []
    real = profile_cache.profile_model

    def counted(*a, **k):
        calls.append(1)
        prof = real(*a, **k)
        prof.layers[0] = LayerProfile("embedding", 123.0, 456.0, 1, 1, 1, 1)  # marks this measurement
        return prof

    monkeypatch.setattr(profile_cache, "profile_model", counted)
    lines: list[str] = []
    load_or_profile(cfg, log=lines.append, now=lambda: mtime + 7200)
    assert calls == [] and lines == [
        f"profile: reusing cached {path} (4 layers), measured 2 h 00 min ago; to measure again: oobleck plan "
        "--reprofile, or planning.reprofile=true for a job"
    ]
    lines.clear()
    again = load_or_profile(cfg, log=lines.append, reprofile=True, now=lambda: mtime + 90)
    assert calls == [1]
    assert lines[0] == f"profile: measuring again as asked (reprofile): replacing {path}, measured 1 min 30 s ago"
    assert ModelProfile.load(path).layers[0].forward_s == 123.0 == again.layers[0].forward_s  # the file was replaced
    cfg.planning.reprofile = True  # the config's way (a job)
    load_or_profile(cfg, log=lambda _: None)
    assert calls == [1, 1]


def test_the_profiler_measures_the_input_and_weight_gradients_apart(monkeypatch):
    """Each layer's backward is also timed as torch's zero-bubble stages split it: the input's
    gradient (I), then the weights' (W). On the real clock both are recorded (> 0: wall times on
    a shared machine are compared no further). On a clock that advances by the FLOPs run (as in
    test_profile_memory.py), I + W is exactly the whole backward's work, and for a transformer
    block I = W = the forward (Qi et al.'s I = W)."""
    lm = build_layer_model(ModelConfig(vocab_size=V, hidden_size=H, num_layers=2, num_heads=4, max_seq_len=L), seed=0)
    ids = torch.randint(0, V, (B, L))
    prof = profile_layers(lm.layers, ids, ids, lm.loss_fn, warmup=1, repeats=3, names=lm.names)
    embedding, *blocks, head = prof.layers
    assert embedding.input_grad_s == 0.0 and embedding.weight_grad_s > 0  # token ids take no gradient
    assert all(p.input_grad_s > 0 and p.weight_grad_s > 0 for p in [*blocks, head])
    again = ModelProfile.from_json(json.loads(json.dumps(prof.to_json())))
    assert [(p.input_grad_s, p.weight_grad_s) for p in again.layers] == [
        (p.input_grad_s, p.weight_grad_s) for p in prof.layers
    ]
    counter = FlopCounterMode(display=False)
    monkeypatch.setattr(
        layer_meter, "time", types.SimpleNamespace(perf_counter=lambda: counter.get_total_flops() * 2.0**-40)
    )
    with counter:
        flops = profile_layers(lm.layers, ids, ids, lm.loss_fn, warmup=0, repeats=1, names=lm.names)
    for p in flops.layers[1:]:
        assert p.input_grad_s + p.weight_grad_s == p.backward_s > 0
    for p in flops.layers[1:-1]:
        assert p.input_grad_s == p.weight_grad_s == p.forward_s


def test_a_profile_without_the_split_loads_and_one_with_half_of_it_is_refused():
    old = {"name": "l0", "forward_s": 1.0, "backward_s": 2.0, "param_bytes": 1, "grad_bytes": 1}
    old |= {"optimizer_bytes": 2, "activation_bytes": 3}
    prof = ModelProfile.from_json({"layers": [old]})
    assert prof.layers[0].input_grad_s is None and not prof.layers[0].split_measured
    assert prof.layers[0].split_backward(0.25) == (1.5, 0.5)
    assert "input_grad_s" not in json.dumps(prof.to_json())  # written as it was read
    with pytest.raises(ValueError) as err:
        ModelProfile.from_json({"layers": [old | {"input_grad_s": 0.5}]}, source="p.json")
    assert str(err.value) == "p.json: layer 0: layer l0: give both input_grad_s and weight_grad_s, or neither"
    split = ModelProfile.from_json({"layers": [old | {"input_grad_s": 0.5, "weight_grad_s": 1.25}]})
    assert split.layers[0].split_backward(0.25) == (0.5, 1.25)
