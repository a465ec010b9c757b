"""Analytic per-layer profiles for models too large to build here (planning-only configs).

Times from FLOP counts at an assumed sustained throughput, bytes from parameter counts (mixed
precision), no I/W split (the planner's share applies). Both activation checkpointing modes, both
assumed: without recomputation a block keeps (10 + 24 / tp) bytes per token and hidden unit
(Megatron's count, Korthikanti et al. 2022, less the attention scores a fused kernel never keeps),
backward 2x forward; recomputed it keeps its input, backward 3x forward. Tensor parallelism over t
devices splits a block t ways and adds two all-reduces each way (`comm.Links`), counted once in
either backward. It made `configs/profiles/gpt3-175b-tp{1,2,4,8}.json`
(`python -m oobleck_elastic.planning.profile.analytic --tensor-parallel T`). docs/planning.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..comm import Links
from .profile import LayerProfile, ModelProfile


def transformer_profile(
    *,
    num_layers: int,
    hidden: int,
    vocab: int,
    seq_len: int,
    microbatch_size: int,
    device_tflops: float,
    param_bytes_per_param: int = 2,
    optimizer_bytes_per_param: int = 12,
    name: str = "transformer",
    tensor_parallel: int = 1,
    links: Links = Links(),
) -> ModelProfile:
    """Embedding, `num_layers` decoder blocks and an LM head, for one (microbatch, seq) shape,
    per device with blocks sharded over `tensor_parallel` devices."""
    tokens = microbatch_size * seq_len
    flops_per_s = device_tflops * 1e12
    act_elem = 2  # bf16 activations

    def layer(
        lname: str, params: int, fwd_flops: float, saved: tuple[int, int], out: int, comm_s: float = 0.0
    ) -> LayerProfile:
        """`saved`: the bytes kept for the backward (without recomputation, recomputed)."""
        fwd = fwd_flops / flops_per_s
        return LayerProfile(
            name=lname,
            forward_s=fwd + comm_s,
            backward_s=2.0 * fwd + comm_s,  # 2x forward FLOPs, the collectives once
            param_bytes=params * param_bytes_per_param,
            grad_bytes=params * param_bytes_per_param,
            optimizer_bytes=params * optimizer_bytes_per_param,
            activation_bytes=saved[0],
            output_bytes=out,
            recomputed_backward_s=3.0 * fwd + comm_s,  # + the recomputed forward
            recomputed_activation_bytes=saved[1],
        )

    hidden_out = tokens * hidden * act_elem
    block_params = 12 * hidden * hidden + 13 * hidden
    block_flops = 2 * tokens * block_params + 4 * microbatch_size * seq_len * seq_len * hidden
    tp = tensor_parallel
    # without recomputation: (10 + 24 / tp) x tokens x hidden bytes (module docstring); recomputed: the input
    block_saved = ((10 * tp + 24) * tokens * hidden // tp, hidden_out)
    emb_params = vocab * hidden + seq_len * hidden
    layers = [layer("embedding", emb_params, 2.0 * tokens * hidden, (tokens * 8, tokens * 8), hidden_out)]
    tp_comm = 2 * links.all_reduce_s(hidden_out, tp, same_node=True)  # after attention, after the MLP
    layers += [
        layer(f"block.{i}", block_params // tp, block_flops / tp, block_saved, hidden_out, tp_comm)
        for i in range(num_layers)
    ]
    head_params = vocab * hidden + 2 * hidden
    logits = tokens * vocab * 4  # fp32, kept by the loss in either mode
    head_saved = (2 * hidden_out + logits, hidden_out + logits)  # the final norm's output too, without recomputation
    layers.append(layer("head", head_params, 2.0 * tokens * vocab * hidden, head_saved, 4))
    key = {
        "analytic": name,
        "num_layers": num_layers,
        "hidden": hidden,
        "vocab": vocab,
        "seq_len": seq_len,
        "microbatch_size": microbatch_size,
        "device_tflops": device_tflops,
        "activation_bytes": "megatron-no-attention-scores",
        "tensor_parallel": tp,
    }
    return ModelProfile(layers=layers, key=key, tensor_parallel=tp)


def gpt3_175b_profile(
    *, microbatch_size: int = 1, device_tflops: float = 150.0, tensor_parallel: int = 1
) -> ModelProfile:
    """96 blocks of width 12288, sequence 2048, GPT-2 vocabulary; A100-class throughput."""
    return transformer_profile(
        num_layers=96,
        hidden=12288,
        vocab=50257,
        seq_len=2048,
        microbatch_size=microbatch_size,
        device_tflops=device_tflops,
        name="gpt3-175b",
        tensor_parallel=tensor_parallel,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description="Write the analytic GPT-3 175B profile as JSON.")
    ap.add_argument("--out", default="configs/profiles/gpt3-175b-tp{tp}.json")
    ap.add_argument("--tensor-parallel", type=int, default=1)
    ap.add_argument("--microbatch-size", type=int, default=1)
    ap.add_argument("--device-tflops", type=float, default=150.0)
    args = ap.parse_args()
    out = Path(args.out.replace("{tp}", str(args.tensor_parallel)))
    gpt3_175b_profile(
        microbatch_size=args.microbatch_size, device_tflops=args.device_tflops, tensor_parallel=args.tensor_parallel
    ).save(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
