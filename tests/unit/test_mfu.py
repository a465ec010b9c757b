"""MFU: FLOPs per token as torchtitan counts them, the peak table, and what a step achieved."""

from __future__ import annotations

import pytest

from oobleck_elastic.config import load_config
from oobleck_elastic.engine.telemetry.mfu import PEAK_TFLOPS, Throughput, flops_per_token, peak_for_name, peak_row


def test_flops_per_token_is_6n_plus_attention_for_gpt2_small() -> None:
    """GPT-2 small at vocab 50304, seq 1024: N = 12 blocks x 7,087,872 + ln_f + the tied head
    (50304 x 768), embeddings excluded; attention 12 x 12 x 768 x 1024."""
    cfg = load_config(
        None,
        [
            "model.vocab_size=50304",
            "model.hidden_size=768",
            "model.num_layers=12",
            "model.num_heads=12",
            "model.max_seq_len=1024",
            "data.seq_len=1024",
        ],
    )
    block = (768 * 2304 + 2304) + (768 * 768 + 768) + (768 * 3072 + 3072) + (3072 * 768 + 768) + 4 * 768
    n = 12 * block + 2 * 768 + 50304 * 768
    assert flops_per_token(cfg) == 6 * n + 12 * 12 * 768 * 1024
    # a longer sequence adds attention only
    assert flops_per_token(cfg, 2048) - flops_per_token(cfg) == 12 * 12 * 768 * 1024


def test_llama_counts_the_untied_head_and_gqa_projections() -> None:
    cfg = load_config(
        None,
        [
            "model.family=llama",
            "model.vocab_size=1024",
            "model.hidden_size=64",
            "model.num_layers=2",
            "model.num_heads=4",
            "model.num_kv_heads=2",
            "model.intermediate_size=128",
            "model.tie_embeddings=false",
            "data.seq_len=32",
        ],
    )
    kv = 64 // 4 * 2
    block = 64 * 64 * 2 + 64 * kv * 2 + 3 * 64 * 128 + 2 * 64
    n = 2 * block + 64 + 1024 * 64
    assert flops_per_token(cfg) == 6 * n + 12 * 2 * 64 * 32


@pytest.mark.parametrize(
    "name,precision,tf32,peak",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", True, 989.5),
        ("NVIDIA H100 PCIe", "bf16", True, 756.5),
        ("NVIDIA H100 NVL", "fp32", True, 417.8),
        ("NVIDIA H200", "fp32", False, 66.9),
        ("NVIDIA A100-SXM4-80GB", "bf16", False, 312.0),
        ("NVIDIA L4", "bf16", False, 121.0),
        ("NVIDIA L40", "bf16", False, 181.05),
        ("NVIDIA GH200 480GB", "fp32", True, 494.7),
        ("Tesla T4", "bf16", False, None),
    ],
)
def test_peak_comes_from_the_table_by_name_and_precision(name, precision, tf32, peak) -> None:
    assert peak_for_name(name, precision, tf32=tf32) == peak


NAMES = {
    # every row, as torch.cuda.get_device_name() spells the device
    "gb200": "NVIDIA GB200",
    "b200": "NVIDIA B200",
    "gh200": "NVIDIA GH200 480GB",
    "h200": "NVIDIA H200",
    "h100 nvl": "NVIDIA H100 NVL",
    "h100 pcie": "NVIDIA H100 PCIe",
    "h100": "NVIDIA H100 80GB HBM3",
    "a100": "NVIDIA A100-SXM4-80GB",
    "l40s": "NVIDIA L40S",
    "l40": "NVIDIA L40",
    "l4": "NVIDIA L4",
    "a10g": "NVIDIA A10G",
    "a10": "NVIDIA A10",
}


def test_every_row_of_the_peak_table_is_matched_by_its_own_device_name_only() -> None:
    assert set(NAMES) == set(PEAK_TFLOPS)
    for row, name in NAMES.items():
        assert peak_row(name) == row, name
    # whole words: a longer model number is not a shorter one's row; unknown devices stay unknown
    for name in ("NVIDIA L40G", "NVIDIA A1000", "NVIDIA RTX A6000", "Tesla T4", "AMD Instinct MI300X", "cpu"):
        assert peak_row(name) is None, name
    assert peak_row("NVIDIA A100 80GB PCIe") == "a100"


def test_throughput_per_device_and_mfu() -> None:
    t = Throughput.of(tokens=8192, seconds=0.5, flops_per_token=1e9, devices=4, peak_tflops=100.0)
    assert t.tokens_per_s == 16384
    assert t.tflops_per_device == pytest.approx(16384 * 1e9 / 4 / 1e12)
    assert t.mfu == pytest.approx(t.tflops_per_device / 100)
    assert "MFU 4.1 %" in t.describe()
    unknown = Throughput.of(tokens=1, seconds=1, flops_per_token=1, devices=1, peak_tflops=None)
    assert unknown.mfu is None and "MFU unknown (set training.peak_tflops)" in unknown.describe()
    assert "MFU" not in unknown.describe(hint=False)  # progress lines after the first say it no more
    assert t.describe(hint=False) == t.describe()  # a known MFU is always said


def test_a_custom_model_reports_unknown_flops_instead_of_a_guess() -> None:
    """A user's own layer list: its blocks, width and attention are not known, so there is no
    FLOPs count (it used to count `model.num_layers` blocks of `model.hidden_size` that the
    factory never built), and throughput says so."""
    cfg = load_config(None, ["model.family=custom", "model.custom_factory=tests.somewhere:layers"])
    assert flops_per_token(cfg) is None
    t = Throughput.of(tokens=1000, seconds=2.0, flops_per_token=None, devices=4, peak_tflops=100.0)
    assert (t.tokens_per_s, t.tflops_per_device, t.mfu) == (500.0, None, None)
    assert t.describe() == "500 tokens/s, TFLOP/s and MFU unknown (a custom model)"
    assert t.describe(hint=False) == "500 tokens/s"
