"""Training-step speed of the DFlash objective: random drafter weights, random target parts and random data.

    python benchmarks/bench_train.py --hidden 576 --layers 2 --target-layers 5 --vocab 49152 --seq 512 \
        --anchors 64 --block 16 --batch 1 --dtype bf16

A step is what the trainer does per micro batch (dflash_train.support.measure.step_fn, the demo's probe times the same):
sample anchors, drafter forward over all blocks, LM head + CE, backward, AdamW step (no DeepSpeed, one process).
Reported: median step time over --steps after --warmup steps, tokens/s (sequence tokens: batch x seq per step), peak
memory, and on CUDA the model FLOPs utilisation.

--attention picks the block attention (blockwise: batched SDPA per block, the CPU default; sdpa: one SDPA call
with a dense [N*B, S+N*B] mask; flex: compiled FlexAttention, the CUDA default); --head picks the LM head + CE
(fused: chunked, gradient computed in the same pass; checkpointed: full logits, recomputed in backward as the
public trainers do). `--baseline` = --attention sdpa --head checkpointed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train.py: before torch loads OpenMP

import torch  # noqa: E402

from dflash_train.support.measure import make_drafter, step_fn  # noqa: E402

H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s (H100/H200 SXM)


def model_flops(args, drafter, blocks) -> float:
    """Useful FLOPs of one training step: 3x forward for the drafter (weights get gradients), 2x for the frozen
    head (forward + input gradient); attention counts only the keys a block may see."""
    c = drafter.config
    H, I, h, kv, d = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    b, S = args.batch, args.seq
    q_tokens = int(blocks.keep.sum()) * args.block
    per_block_token = 2 * (H * h * d * 2 + H * kv * d * 2 + 3 * H * I)  # q, o, k, v, MLP
    per_ctx_token = 2 * (H * kv * d * 2)  # k, v of the context
    visible = float((blocks.anchors.float()[blocks.keep]).sum()) * args.block + q_tokens * args.block
    attn = 2 * 2 * h * d * visible
    fwd = c.num_hidden_layers * (q_tokens * per_block_token + b * S * per_ctx_token + attn) + b * S * 2 * (
        len(drafter.target_layer_ids) * H * H)
    supervised = int(blocks.keep.sum()) * (args.block - 1)
    return 3 * fwd + 2 * (2 * supervised * H * args.vocab)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--target-layers", type=int, default=5)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--anchors", type=int, default=64)
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attention", choices=["blockwise", "sdpa", "flex"], default=None)
    p.add_argument("--head", choices=["fused", "checkpointed"], default="fused")
    p.add_argument("--head-chunk", type=int, default=256)
    p.add_argument("--baseline", action="store_true", help="--attention sdpa --head checkpointed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    args = p.parse_args(argv)
    if args.baseline:
        args.attention, args.head = "sdpa", "checkpointed"
    device = torch.device(args.device)
    args.attention = args.attention or ("flex" if device.type == "cuda" else "blockwise")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32

    drafter = make_drafter(args, device, dtype)
    g = torch.Generator().manual_seed(1)
    embed = (torch.randn(args.vocab, args.hidden, generator=g) * 0.02).to(device=device, dtype=dtype)
    head = embed  # tied, as in SmolLM2; frozen either way
    batch = {
        "input_ids": torch.randint(0, args.vocab - 1, (args.batch, args.seq), generator=g).to(device),
        "loss_mask": torch.ones(args.batch, args.seq, dtype=torch.bool, device=device),
        "hidden_states": torch.randn(args.batch, args.seq, args.target_layers * args.hidden, generator=g).to(
            device=device, dtype=dtype),
        "position_ids": torch.arange(args.seq, device=device).expand(args.batch, -1),
    }
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=6e-4, weight_decay=0.0, fused=True)
    times, blocks = [], None
    for step in range(args.warmup + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        blocks = step_fn(args, drafter, embed, head, batch, optimizer, step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    result = {
        "device": device.type if device.type == "cpu" else torch.cuda.get_device_name(device),
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "config": {k: getattr(args, k) for k in ("hidden", "layers", "target_layers", "vocab", "seq", "anchors",
                                                  "block", "batch", "dtype", "attention", "head")},
        "drafter_params": sum(p.numel() for p in drafter.parameters()),
        "step_s_median": round(median, 4),
        "step_s_min": round(min(times), 4),
        "tokens_per_s": round(args.batch * args.seq / median, 1),
    }
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
        result["mfu"] = round(model_flops(args, drafter, blocks) / median / H200_BF16_PEAK, 4)
    else:
        result["peak_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 2)
    result["model_tflops_per_step"] = round(model_flops(args, drafter, blocks) / 1e12, 4)
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:>22}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
