"""Profiling holds one layer at a time; identical blocks are built and measured once, and plan
exactly as when every block is measured."""

from __future__ import annotations

import dataclasses
import types
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from oobleck_elastic import cli, models
from oobleck_elastic.config import JobConfig, ModelConfig, load_config
from oobleck_elastic.models import LayerModel
from oobleck_elastic.models import build as build_module
from oobleck_elastic.planning import LayerProfile, ModelProfile, plan_job, templates_for
from oobleck_elastic.planning.profile import layer_meter, profiler

ROOT = Path(__file__).resolve().parents[2]
MEMORY_FIELDS = ("name", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes", "output_bytes")
GIB = 1024**3


def memory(prof: ModelProfile) -> list[tuple]:
    return [tuple(getattr(p, f) for f in MEMORY_FIELDS) for p in prof.layers]


def small_job(family: str = "gpt2", *, num_layers: int = 4, once: bool = True) -> JobConfig:
    cfg = JobConfig()
    cfg.model = ModelConfig(
        family=family,
        vocab_size=128,
        hidden_size=32,
        num_layers=num_layers,
        num_heads=4,
        max_seq_len=16,
        tie_embeddings=family == "gpt2",
    )
    cfg.data.seq_len, cfg.training.microbatch_size = 16, 2
    cfg.planning.profile_warmup, cfg.planning.profile_repeats = 0, 1
    cfg.planning.profile_identical_blocks_once = once
    return cfg


class BuildRecorder:
    """Stands in for `models.build_layer_model`: records the layers each call builds, and fails a
    call while any layer, or any parameter, that an earlier call built is still alive."""

    def __init__(self, real) -> None:  # noqa: ANN001
        self.real, self.calls, self.refs = real, [], []

    def alive(self) -> list[str]:
        return [name for name, ref in self.refs if ref() is not None]

    def __call__(self, cfg: ModelConfig, *, seed: int, **kwargs) -> LayerModel:  # noqa: ANN003
        assert not self.alive(), f"a new layer is built while {self.alive()} are still alive"
        lm = self.real(cfg, seed=seed, **kwargs)
        built = [i for i, layer in enumerate(lm.layers) if layer is not None]
        self.calls.append(built)
        for i in built:
            self.refs.append((lm.names[i], weakref.ref(lm.layers[i])))
            self.refs += [(f"{lm.names[i]}.{n}", weakref.ref(p)) for n, p in lm.layers[i].named_parameters()]
        return lm


def test_profile_model_holds_one_layer_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer is built alone and is gone, parameters included, before the next is built;
    the numbers are those of profiling the whole model at once (the tied head counts its weight)."""
    cfg = small_job(num_layers=6, once=False)
    rec = BuildRecorder(models.build_layer_model)
    monkeypatch.setattr(models, "build_layer_model", rec)
    prof = profiler.profile_model(cfg, device="cpu")
    assert rec.calls == [[]] + [[i] for i in range(8)]  # [] = names and loss only
    assert not rec.alive()
    monkeypatch.undo()
    lm = models.build_layer_model(cfg.model, seed=cfg.training.seed)
    ids = torch.zeros(2, 16, dtype=torch.long)
    whole = profiler.profile_layers(lm.layers, ids, ids, lm.loss_fn, warmup=0, repeats=1, names=lm.names)
    assert memory(prof) == memory(whole)
    assert prof.layers[-1].param_bytes == (128 * 32 + 2 * 32) * 4  # lm_head (= wte) and ln_f


def test_a_pretrained_model_is_read_one_layer_at_a_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import transformers

    conf = transformers.GPT2Config(
        vocab_size=128, n_positions=16, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )  # the dropout of small_job: the same work
    transformers.GPT2LMHeadModel(conf).save_pretrained(tmp_path / "gpt2")
    cfg = small_job(num_layers=3, once=False)
    random = profiler.profile_model(cfg, device="cpu")
    cfg.model.pretrained_path = str(tmp_path / "gpt2")
    rec = BuildRecorder(models.build_layer_model)
    monkeypatch.setattr(models, "build_layer_model", rec)
    prof = profiler.profile_model(cfg, device="cpu")
    assert rec.calls == [[]] + [[i] for i in range(5)] and not rec.alive()
    assert memory(prof) == memory(random)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_identical_blocks_are_built_and_measured_once(monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    cfg = small_job(family, num_layers=5)
    rec = BuildRecorder(models.build_layer_model)
    monkeypatch.setattr(models, "build_layer_model", rec)
    measured: list[str] = []
    real_measure = layer_meter.LayerMeter.measure

    def counting(self, layer: nn.Module, x: torch.Tensor, *, last: bool, name: str, **kw):  # noqa: ANN001, ANN202
        measured.append(name)
        return real_measure(self, layer, x, last=last, name=name, **kw)

    monkeypatch.setattr(layer_meter.LayerMeter, "measure", counting)
    lines: list[str] = []
    once = profiler.profile_model(cfg, device="cpu", log=lines.append)
    assert rec.calls == [[], [0], [1], [6]] and measured == ["embedding", "block.0", "head"]
    assert "identical blocks measured once" in lines[0]
    assert "profiling layers 3-6/7 block.1..block.4: identical to block.0, their numbers reused" in lines
    assert not any("profiling layer 4/7" in line for line in lines)  # one line for the run, not one per layer
    names = ["embedding", *(f"block.{i}" for i in range(5)), "head"]
    assert [p.name for p in once.layers] == names
    assert all(dataclasses.replace(p, name="block.0") == once.layers[1] for p in once.layers[1:6])
    cfg.planning.profile_identical_blocks_once = False
    full = profiler.profile_model(cfg, device="cpu")
    assert measured[3:] == names  # every layer measured
    assert memory(once) == memory(full)  # byte counts depend on shapes only: exactly equal


def test_only_one_kind_on_one_input_shape_shares_numbers() -> None:
    """Class, plain attributes, parameter shapes, the input's shape and the output's shape all
    have to match before a layer reuses an earlier layer's numbers."""
    torch.manual_seed(0)
    layers = [
        nn.Linear(8, 8),
        nn.Linear(8, 8),  # identical: the second reuses the first
        nn.Linear(8, 8, bias=False),  # other parameters
        nn.Dropout(0.1),
        nn.Dropout(0.5),  # other attributes
        nn.AvgPool1d(2),
        nn.AvgPool1d(2),  # same kind, input 8 wide then 4 wide
        nn.Linear(2, 4),
        nn.Linear(4, 2),
        nn.Linear(2, 4),  # same kind and input, but the output
        nn.Linear(4, 2),
    ]  # (4 wide) is not the input (2 wide) the next layer gets: measured
    x = torch.randn(2, 4, 8)
    lines: list[str] = []
    once = profiler.profile_layers(
        layers, x, torch.zeros(2, 4, 2), nn.functional.mse_loss, repeats=1, identical_blocks_once=True, log=lines.append
    )
    assert [line.split(":")[0] for line in lines if "identical" in line] == ["profiling layer 2/11 layer.1"]
    full = profiler.profile_layers(layers, x, torch.zeros(2, 4, 2), nn.functional.mse_loss, repeats=1)
    assert memory(once) == memory(full)
    assert profiler.layer_kind(layers[0]) == profiler.layer_kind(nn.Linear(8, 8))
    assert profiler.layer_kind(layers[0]) != profiler.layer_kind(nn.Linear(8, 8).double())


def flop_clock(counter: FlopCounterMode) -> types.SimpleNamespace:
    """A stand-in for the layer meter's `time` module: perf_counter() is the number of floating-point
    operations run so far x 2^-40 s (exact in binary, so differences are exact)."""
    return types.SimpleNamespace(perf_counter=lambda: counter.get_total_flops() * 2.0**-40)


SHIPPED = {
    "gpt2-tiny": [],
    "llama-tiny": [],
    # microbatch 1 x 32 tokens (of 4 x 512) keeps it to seconds on a CPU; the model is unchanged
    "gpt2-small": ["training.microbatch_size=1", "data.seq_len=32"],
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_configs_plan_the_same_with_identical_blocks_measured_once(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The templates and plans (every node count the templates cover) from a profile with
    identical blocks measured once equal those from a profile with every block measured.

    Wall-clock times differ between two runs of the same layer (noise), so two measured profiles
    never agree and their plans may differ for that reason alone. The profiler's clock is
    therefore replaced by a deterministic one that advances by the work done (FLOPs counted by
    FlopCounterMode, forward and backward): each layer's time is a function of what it computes,
    as a noise-free measurement would be. Under it the profile with reuse must equal the one with
    every block measured field by field (times, bytes, names: a block given another kind's numbers,
    a wrong name or a wrong input for the head shows up here), and so must the plans."""
    counter = FlopCounterMode(display=False)
    monkeypatch.setattr(layer_meter, "time", flop_clock(counter))
    # one iteration per layer: the clock has no noise to take a median of
    cfg = load_config(
        ROOT / "configs" / f"{name}.yaml", [*SHIPPED[name], "planning.profile_warmup=0", "planning.profile_repeats=1"]
    )
    profiles = {}
    for once in (True, False):
        cfg.planning.profile_identical_blocks_once = once
        with counter:
            profiles[once] = profiler.profile_model(cfg, device="cpu")
    once, full = profiles[True], profiles[False]
    blocks = once.layers[1:-1]
    assert all(p.forward_s > 0 and p.backward_s > p.forward_s for p in blocks)  # the clock counts work
    assert once.layers[-1].time_s != blocks[0].time_s
    assert once.layers == full.layers
    templates = {k: templates_for(cfg, p) for k, p in profiles.items()}
    assert templates[True].to_json() == templates[False].to_json()
    for nodes in templates[True].sizes():
        plans = [cli.plan_json(plan_job(cfg, nodes=nodes, templates=templates[k])) for k in (True, False)]
        assert plans[0] == plans[1]


def test_gpt3_175b_profiles_on_a_device_that_holds_one_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """configs/gpt3-175b.yaml (175B parameters, 650 GiB in fp32) cannot be run here, so its layers
    are built on the meta device and the measurement of a layer is replaced by a stand-in that
    records what it was given; the real one-at-a-time path is checked on small models above.
    profile_model builds 1 of the 96 blocks with reuse and one layer at a time without, and the
    most it ever holds is one block of 1.8B parameters: params + grads 13.5 GiB, within the
    config's 80 GiB device, where the whole model is not."""
    cfg = load_config(ROOT / "configs/gpt3-175b.yaml", ["planning.profile_path=null"])
    n, h = cfg.model.num_layers + 2, cfg.model.hidden_size
    metas = build_module.build_meta_layers(cfg.model, n, seed=cfg.training.seed)
    params = [sum(p.numel() for p in layer.parameters()) for layer in metas]
    total = sum(params) - cfg.model.vocab_size * h  # lm_head is the embedding's wte
    assert 174e9 < total < 176e9 and max(params) == params[1] == 12 * h * h + 13 * h
    monkeypatch.setattr(build_module, "build_meta_layers", lambda model_cfg, end, *, seed: metas[:end])
    names = ["embedding", *(f"block.{i}" for i in range(n - 2)), "head"]
    built: list[list[int]] = []

    def build_on_meta(model_cfg, *, seed, owned=None, device="cpu"):  # noqa: ANN001, ANN202
        owned = sorted(owned) if owned is not None else list(range(n))
        built.append(owned)
        return LayerModel(layers=[metas[i] if i in owned else None for i in range(n)], names=names, hf_names=[{}] * n)

    held: list[int] = []

    def measure(self, layer: nn.Module, x: torch.Tensor, *, last: bool, name: str, **_: object):  # noqa: ANN001, ANN202
        pbytes = 4 * sum(p.numel() for p in layer.parameters())
        held.append(pbytes)
        out = torch.empty(*x.shape[:2], h, device="meta")
        return LayerProfile(name, 1.0, 2.0, pbytes, pbytes, 2 * pbytes, 0, out.numel() * 4), out

    collected: list[int] = []  # a full gc with 98 meta layers alive takes ~0.2 s: count them instead
    monkeypatch.setattr(models, "build_layer_model", build_on_meta)
    monkeypatch.setattr(layer_meter.LayerMeter, "measure", measure)
    monkeypatch.setattr(profiler, "gc", types.SimpleNamespace(collect=lambda: collected.append(len(held))))
    for once in (True, False):
        built.clear()
        held.clear()
        collected.clear()
        cfg.planning.profile_identical_blocks_once = once
        prof = profiler.profile_model(cfg, device="cpu")
        assert built == ([[], [0], [1], [n - 1]] if once else [[], *([i] for i in range(n))])
        assert prof.num_layers == n and [p.name for p in prof.layers] == names
        assert len({dataclasses.replace(p, name="") for p in prof.layers[1:-1]}) == 1
        assert max(held) == 4 * params[1]
        assert collected == list(range(1, len(held) + 1))  # after every layer measured
    assert 2 * max(held) < 14 * GIB < cfg.planning.device_memory_gb * GIB < 4 * total
