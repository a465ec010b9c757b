"""Static stage shapes (engine/stage/shapes.py): `stage_io` equals what the real layers produce (shape,
stride, dtype, requires_grad) for GPT-2, Llama, a pretrained directory and custom factories, in fp32
and under bf16 autocast; and pipelines built with them train to the single-process reference while
every way of exchanging pickled objects raises in every worker."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers
from torch import nn

from oobleck_elastic.config import ModelConfig, from_dict, load_config, to_dict
from oobleck_elastic.engine.stage.shapes import stage_io
from oobleck_elastic.engine.stage.build import Autocast
from oobleck_elastic.engine.trainer import Trainer
from oobleck_elastic.models import build_layer_model, hf_config
import helpers
import ranks
from helpers import RandomTokens, layout_plan

ROOT = Path(__file__).resolve().parents[2]
MB, SEQ = 2, 16
STEPS = 2
NUM_LAYERS = 6  # gpt2-tiny: embedding, 4 blocks, head


def meta_of(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.requires_grad


def real_io(lm, start: int, end: int, dtype: torch.dtype | None, tokens: torch.Tensor) -> tuple:
    """(input, output) of the real stage [start, end) as the trainer runs it: Autocast-wrapped, the
    input of a later stage being the earlier stages' output as a fresh leaf (as torch receives it)."""
    x = tokens
    if start > 0:
        x = Autocast(lm.stage(0, start), dtype)(tokens)
        x = x.detach().requires_grad_(x.requires_grad)
    return x, Autocast(lm.stage(start, end), dtype, last=end == lm.num_layers)(x)


def assert_stage_io(cfg: ModelConfig, lm, dtype: torch.dtype | None, seed: int = 0, vocab: int = 256) -> None:
    tokens = torch.randint(0, vocab, (MB, SEQ), generator=torch.Generator().manual_seed(0))
    n = lm.num_layers
    for start in range(n):
        for end in range(start + 1, n + 1):
            inp, out = stage_io(cfg, seed=seed, start=start, end=end, microbatch_size=MB, seq_len=SEQ, autocast=dtype)
            assert inp.device.type == out.device.type == "meta"
            want_in, want_out = real_io(lm, start, end, dtype, tokens)
            assert meta_of(inp) == meta_of(want_in), (start, end, "input")
            assert meta_of(out) == meta_of(want_out), (start, end, "output")


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_stage_io_matches_the_real_layers(name: str, dtype: torch.dtype | None) -> None:
    cfg = load_config(ROOT / f"configs/{name}.yaml").model
    lm = build_layer_model(cfg, seed=0)
    assert_stage_io(cfg, lm, dtype)
    inp, out = stage_io(cfg, seed=0, start=0, end=lm.num_layers, microbatch_size=MB, seq_len=SEQ)
    assert meta_of(inp) == ((MB, SEQ), (SEQ, 1), torch.int64, False)
    assert out.shape == (MB, SEQ, cfg.vocab_size) and out.dtype == torch.float32


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_stage_io_of_a_pretrained_directory(tmp_path: Path, family: str) -> None:
    # dimensions that differ from ModelConfig's defaults: the shapes must come from config.json
    cfg = ModelConfig(
        family=family,
        vocab_size=96,
        hidden_size=24,
        num_layers=3,
        num_heads=4,
        num_kv_heads=None if family == "gpt2" else 2,
        intermediate_size=40,
        max_seq_len=SEQ,
        tie_embeddings=family == "gpt2",
    )
    cls = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[family]
    getattr(transformers, cls)(hf_config(cfg)).save_pretrained(tmp_path / "m")
    pre = ModelConfig(family=family, pretrained_path=str(tmp_path / "m"))
    assert_stage_io(pre, build_layer_model(pre, seed=0), None, vocab=96)
    # the logits have the padded vocabulary's columns (96 tokens -> 128 with model.pad_vocab_to=64)
    assert stage_io(pre, seed=0, start=3, end=5, microbatch_size=MB, seq_len=SEQ)[1].shape == (MB, SEQ, 128)


FACTORY = """
import torch
from torch import nn

class Double(nn.Module):
    def forward(self, x):
        return x.double()

class ItemUser(nn.Module):
    def forward(self, x):
        return x * x.sum().item()

CACHED = [nn.Embedding(256, 8), nn.Linear(8, 12), lambda: nn.Linear(12, 5),
          nn.Sequential(Double(), nn.Linear(5, 3, dtype=torch.float64))]

def layers(cfg):
    return CACHED

def not_on_meta(cfg):  # needs real values while building: built on CPU, then copied to meta
    scale = torch.randn(1).item()
    return [nn.Embedding(256, 4), nn.Linear(4, 4) if scale < 10 else None]

def meta_hostile(cfg):
    return [nn.Embedding(256, 4), ItemUser()]
"""


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "oobleck_shapes_factory.py").write_text(textwrap.dedent(FACTORY))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module("oobleck_shapes_factory")


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_stage_io_of_custom_layers(factory, dtype: torch.dtype | None) -> None:
    cfg = ModelConfig(family="custom", custom_factory="oobleck_shapes_factory:layers")
    lm = build_layer_model(cfg, seed=3)
    assert_stage_io(cfg, lm, dtype, seed=3)
    # the float64 last layer hands on float64 in fp32; under bf16 the model's output (the logits)
    # is bf16 (Autocast's .to(bf16) of the last stage), any other boundary float32
    assert lm.num_layers == 4
    out = stage_io(cfg, seed=3, start=1, end=4, microbatch_size=MB, seq_len=SEQ, autocast=dtype)[1]
    assert out.dtype == (torch.float64 if dtype is None else torch.bfloat16)
    # the factory's own modules are not moved to the meta device
    assert all(p.device.type == "cpu" for m in factory.CACHED if isinstance(m, nn.Module) for p in m.parameters())

    cpu_only = ModelConfig(family="custom", custom_factory="oobleck_shapes_factory:not_on_meta")
    inp, out = stage_io(cpu_only, seed=0, start=1, end=2, microbatch_size=MB, seq_len=SEQ)
    assert meta_of(inp) == meta_of(out) == ((MB, SEQ, 4), (SEQ * 4, 4, 1), torch.float32, True)


def test_stage_io_errors(factory) -> None:
    hostile = ModelConfig(family="custom", custom_factory="oobleck_shapes_factory:meta_hostile")
    with pytest.raises(RuntimeError, match=r"layer 1 \(ItemUser\) cannot run on the meta device"):
        stage_io(hostile, seed=0, start=1, end=2, microbatch_size=MB, seq_len=SEQ)
    gpt2 = load_config(ROOT / "configs/gpt2-tiny.yaml").model
    with pytest.raises(ValueError, match="the model has 6 layers"):
        stage_io(gpt2, seed=0, start=2, end=7, microbatch_size=MB, seq_len=SEQ)
    with pytest.raises(ValueError, match="0 <= start < end"):
        stage_io(gpt2, seed=0, start=3, end=3, microbatch_size=MB, seq_len=SEQ)


# --------------------------------------------------------------------- no pickles between workers


# one pipeline of three stages, 8 microbatches (1F1B); the tied wte/lm_head is split over stages 0 and 2
PLAN = layout_plan([[(0, 2), (2, 4), (4, 6)]], [8], generation=1, num_layers=NUM_LAYERS, microbatch_size=MB)
WORLD = 3


def config(**over):
    # eps=1e-6: the attention key bias has a mathematically zero gradient (softmax ignores a shift of
    # all keys), so its gradient is rounding noise of ~1e-10 that AdamW with eps=1e-8 would blow up to
    # a full lr-sized update in a random direction; a larger eps keeps noise-level gradients noise-level
    # and the comparison about the math.
    return load_config(
        ROOT / "configs/gpt2-tiny.yaml",
        [
            f"data.seq_len={SEQ}",
            "training.global_batch_size=16",
            f"training.microbatch_size={MB}",
            f"training.steps={STEPS}",
            "training.optimizer.eps=1e-6",
            *[f"{k}={v}" for k, v in over.items()],
        ],
    )


class PickleExchange(AssertionError):
    pass


def _forbid_pickles() -> None:
    """Make every path by which torch exchanges pickled objects between ranks raise."""
    from torch.distributed import distributed_c10d
    from torch.distributed.pipelining import schedules, stage

    def forbidden(*args, **kwargs):
        raise PickleExchange("a pickled object was to be exchanged between ranks")

    names = (
        "send_object_list",
        "recv_object_list",
        "broadcast_object_list",
        "all_gather_object",
        "gather_object",
        "scatter_object_list",
    )
    for module in (dist, distributed_c10d, stage, schedules):  # also where imported by name
        for name in names:
            if hasattr(module, name):
                setattr(module, name, forbidden)
    distributed_c10d._tensor_to_object = forbidden  # the one unpickling helper behind them all
    stage.PipelineStage._send_meta = forbidden  # type: ignore[method-assign]
    stage.PipelineStage._recv_meta = forbidden  # type: ignore[method-assign]


def _dynamic_stage_is_caught(group: dist.ProcessGroup, index: int, stages: int) -> bool:
    """Control: a stage WITHOUT input_args/output_args does try to exchange pickles (and is stopped)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pstage = PipelineStage(nn.Linear(4, 4), index, stages, torch.device("cpu"), group=group)
    schedule = ScheduleGPipe(pstage, n_microbatches=2, loss_fn=lambda out, y: out.sum(), scale_grads=False)
    try:
        if index == 0:
            schedule.step(torch.ones(4, 4))
        elif index == stages - 1:
            schedule.step(target=torch.ones(4, 4))
        else:
            schedule.step()
    except PickleExchange:
        return True
    return False


def _worker(rank: int, tmp: str, cfgs: dict[str, dict]) -> None:
    from torch.distributed.pipelining._utils import InferenceMode

    torch.set_num_threads(1)
    _forbid_pickles()
    for name, cfg_dict in cfgs.items():
        cfg = from_dict(cfg_dict)
        store = dist.FileStore(os.path.join(tmp, f"store-{name}"), WORLD)
        trainer = Trainer(cfg, dataset=RandomTokens(seq_len=SEQ), plan=PLAN, rank=rank, store=store)
        pstage = trainer.schedule._stage  # torch-private: check torch against our metadata at run time
        pstage._runtime_validate = True
        for step in range(STEPS):
            trainer.train_step(step)
        assert pstage._inference_mode == InferenceMode.STATIC
        torch.save(
            {f"{i}:{n}": t for i, layer in trainer.checkpoint_state.layer_state().items() for n, t in layer.items()},
            os.path.join(tmp, f"{name}-rank{rank}.pt"),
        )
        if name == "fp32":
            assert _dynamic_stage_is_caught(trainer.groups.pipeline_group, trainer.stage.index, WORLD)
        trainer.close()


def reference_state(cfg) -> dict[str, torch.Tensor]:
    return helpers.reference_state(cfg, RandomTokens(seq_len=SEQ), STEPS)


# bf16 needs no looser tolerance than fp32: the pipeline runs the same bf16-autocast ops on the same
# microbatches as the reference (fp32 master weights and optimizer in both), and the only thing a stage
# boundary adds, Autocast's .float(), is a no-op on GPT-2's residual stream, which stays float32 under
# autocast (fp32 embeddings; residual adds promote the bf16 attention/MLP outputs). Measured: largest
# |pipeline - reference| 6e-8 in bf16 (1.2e-7 in fp32), i.e. summation order only.
TOL = {"rtol": 1e-5, "atol": 1e-6}


@pytest.mark.slow
def test_static_stages_train_like_the_reference_without_pickles(tmp_path: Path) -> None:
    cfgs = {"fp32": config(), "bf16": config(**{"training.precision": "bf16"})}
    ranks.spawn(_worker, args=(str(tmp_path), {k: to_dict(c) for k, c in cfgs.items()}), nprocs=WORLD)
    refs = {name: reference_state(cfg) for name, cfg in cfgs.items()}
    fresh = helpers.reference_state(cfgs["fp32"], RandomTokens(seq_len=SEQ), 0)
    for name, ref in refs.items():
        merged: dict[str, list[torch.Tensor]] = {}
        for rank in range(WORLD):
            for key, t in torch.load(tmp_path / f"{name}-rank{rank}.pt", weights_only=True).items():
                merged.setdefault(key, []).append(t)
        assert set(merged) == set(ref), f"{name}: parameters missing"
        for key, copies in merged.items():
            for t in copies:  # every replica (the tied wte/lm_head has two) equals the reference
                torch.testing.assert_close(t, ref[key], **TOL, msg=f"{name}: {key}")
        moved = [k for k, t in ref.items() if not torch.equal(t, fresh[k])]
        assert len(moved) == len(ref), f"{name}: training did not move every parameter"
    # bf16 really ran in bf16: its weights are not the fp32 ones
    assert max((refs["bf16"][k] - t).abs().max().item() for k, t in refs["fp32"].items()) > 1e-5
