"""The DFlash draft model: a few Qwen3 decoder layers that draft a whole block of tokens in one parallel pass.

This file is the model. dflash-train trains this very module, and copies it byte for byte into every saved drafter
folder as `dflash.py`, the remote code of `AutoModel.from_pretrained(DIR, trust_remote_code=True)`. So it imports
torch and transformers only. The architecture and the tensor names are those of the public DFlash drafters
(z-lab/dflash), so SGLang and vLLM load the same folder with their own implementations.

Reading guide (one block, at inference):

    target_hidden   [b, S, n*H]  tapped target states (HF hidden_states[i + 1]) of the tokens before the anchor
        -> fc -> hidden_norm                        (fuse_context)
    noise_embedding [b, Q, H]    the target's embeddings of the block [anchor, MASK, MASK, ...]
        -> L x (pre-norm attention + SwiGLU MLP)    queries from the block only;
                                                    keys/values = k/v_proj(context) ++ k/v_proj(block)
        -> norm -> [b, Q, H]
        -> logits(., target head) -> [b, Q, V]      the target's frozen LM head, or a draft vocabulary: its rows
                                                    for some ids only (config `draft_vocab_size`), -inf elsewhere

Positions are absolute and shared with the target: `position_ids` [b, S + Q] cover the context, then the block
(context token t at position t, block slot k at anchor + k). Without a mask every query sees every key; training
packs many blocks into one row of queries and passes the block mask that dflash_train/model/masks.py builds, with
the attention function that reads it (`attention_fn`; default `sdpa_attention`, which takes a dense mask).

With `past_key_values` (a transformers Cache) the context K/V are appended to the cache for good and the block's
K/V are used for this forward only: pass only the newly committed context each step. Cropping the cache to the
committed length after a draft, as the reference's loop does, is therefore a no-op.

    model = AutoModel.from_pretrained(DIR, trust_remote_code=True, dtype=torch.bfloat16)
    out = model.spec_generate(target=target, input_ids=ids, max_new_tokens=256, stop_token_ids=[eos])
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen3.modeling_qwen3 import Qwen3Config, Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq does not depend on the sequence length

# ----------------------------------------------------------------------------------------------------------------
# The target's side of the contract: which layers are tapped, how, and how its KV cache is passed and cropped.
# dflash_train.target re-exports these; they live here because the remote code needs them without dflash_train.


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The default tapped layers, as z-lab/dflash picks them: one layer at L // 2, else n layers evenly spaced
    from 1 to L-3, round(1 + i*(L-4)/(n-1)) (Qwen3-8B, 5 layers: 1, 9, 17, 25, 33)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def tap_layers(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """The outputs of decoder layers `layer_ids`, concatenated on the last dim: HF hidden_states[i + 1]
    (hidden_states[0] is the embedding output). The reference calls this extract_context_feature."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@functools.lru_cache(maxsize=None)
def cache_keyword(model_class: type) -> str:
    """The name a causal LM's forward takes its KV cache under: `cache` in some transformers 5.x releases,
    `past_key_values` before (and in the output, the same name)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers Cache (crop's positive form is gone in v5; its negative
    form removes that many positions in both v4 and v5)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def sample(logits: torch.Tensor, temperature: float = 0.0) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


# ----------------------------------------------------------------------------------------------------------------
# RoPE and attention


class Rotary:
    """RoPE cos/sin for absolute positions, with the target's rope type and scaling (transformers' formulas).

    Not an nn.Module buffer on purpose: `model.to(bfloat16)` (DeepSpeed's bf16 mode does it) must not round the
    inverse frequencies. Built on the CPU whatever the default device (from_pretrained builds on "meta")."""

    def __init__(self, config: Qwen3Config):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope = config.rope_parameters
        rope_type = rope.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported by the drafter (supported: "
                             f"{', '.join(STATIC_ROPE_TYPES)})")
        with torch.device("cpu"):
            if rope_type == "default":
                d, theta = config.head_dim, rope["rope_theta"]
                inv_freq, self.scaling = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
            else:
                inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        self.inv_freq = inv_freq.float()

    def __call__(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, L] -> cos, sin [b, L, head_dim] in `dtype`."""
        self.inv_freq = self.inv_freq.to(position_ids.device)
        with torch.autocast(device_type=position_ids.device.type, enabled=False):
            freqs = position_ids[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, L, d]; cos/sin [b, L, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                   scale: float) -> torch.Tensor:
    """The default attention function: q [b, h, Q, d] over k/v [b, kv_heads, K, d] -> [b, h, Q, d]. `mask`: None
    (every key visible) or a dense tensor broadcastable to [b, h, Q, K] (bool: True = may attend; else additive).

    Every attention function has this signature; the block-sparse ones of training (masks.py) take their own
    kind of mask (a FlexAttention BlockMask, the blockwise visibility groups)."""
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


AttentionFunction = Callable[..., torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------
# The model


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, H, bias=False)
        self.q_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """k (k_norm + RoPE at each token's own position) and v, [b, kv_heads, L, d] each."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor, rope_block, rope_context,
                attention_mask=None, attention_fn: AttentionFunction = sdpa_attention,
                past_key_values=None) -> torch.Tensor:
        b, n, _ = hidden_states.shape
        q = self.q_norm(self.q_proj(hidden_states).view(b, n, self.num_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *rope_block)
        k_ctx, v_ctx = self.keys_values(context, rope_context)
        if past_key_values is not None:  # the new context is committed: keep its K/V for every later draft
            k_ctx, v_ctx = past_key_values.update(k_ctx, v_ctx, self.layer_idx)
        k_blk, v_blk = self.keys_values(hidden_states, rope_block)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        out = attention_fn(q, k, v, attention_mask, self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm attention + SwiGLU MLP. The fused context is the same for every layer and is not normed again:
    only the block is. Checkpointable the transformers way (`model.gradient_checkpointing_enable()`)."""

    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, hidden_states: torch.Tensor, context: torch.Tensor, rope_block, rope_context,
                attention_mask=None, attention_fn: AttentionFunction = sdpa_attention,
                past_key_values=None) -> torch.Tensor:
        x = hidden_states
        x = x + self.self_attn(self.input_layernorm(x), context, rope_block, rope_context, attention_mask,
                               attention_fn, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """config: a Qwen3Config read from the drafter's config.json (its `dflash_config` holds target_layer_ids and
    mask_token_id; `block_size` and `num_target_layers` sit at the top level, as in the reference)."""

    config_class = Qwen3Config
    main_input_name = "noise_embedding"  # no input_ids: the block's embeddings come from the target
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash_config = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash_config.get("target_layer_ids") or build_target_layer_ids(
            config.num_target_layers, config.num_hidden_layers))
        self.mask_token_id = dflash_config.get("mask_token_id")
        self.block_size = int(dflash_config.get("block_size", getattr(config, "block_size", 16)))
        H = config.hidden_size
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=config.rms_norm_eps)
        self.rotary = Rotary(config)
        # Optional per-channel divisor of the tapped states (training only, `set_context_scale`); not part of the
        # checkpoint format: dflash-train folds it into fc when it saves, so every saved drafter has none.
        self.register_buffer("context_scale", None, persistent=False)
        # A draft vocabulary (config `draft_vocab_size` < vocab_size, as vLLM reads it): `lm_head` holds the target
        # head's rows for the ids the drafter drafts, `d2t` each row's offset to its target id (id = row + d2t).
        draft_vocab = getattr(config, "draft_vocab_size", None)
        if draft_vocab is not None and draft_vocab < config.vocab_size:
            self.lm_head = nn.Linear(H, draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        else:
            self.lm_head = None
            self.register_buffer("d2t", None)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Linear weights ~ N(0, initializer_range); norms start at 1 (their constructor's value)."""
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

    def set_context_scale(self, scale: Optional[torch.Tensor]) -> None:
        """Divide the tapped states by `scale` [n*H] (> 0) before fc. The target's tapped states carry a few huge,
        nearly constant channels; dividing every channel by its RMS over real data lets fc start from inputs of
        unit scale. Exact to fold into fc (fc(x / s) = (W / s) x)."""
        if scale is not None:
            scale = scale.detach().float().reshape(-1)
            if scale.numel() != self.fc.in_features or not bool((scale > 0).all()) or not bool(scale.isfinite().all()):
                raise ValueError(f"context scale must be {self.fc.in_features} positive finite values")
            scale = scale.to(self.fc.weight.device)
        self.context_scale = scale

    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Tapped target states [b, S, n*H] -> context vectors [b, S, H]."""
        context = target_hidden.to(self.fc.weight.dtype)
        if self.context_scale is not None:
            context = context / self.context_scale.to(context.dtype)
        return self.hidden_norm(self.fc(context))

    def forward(self, position_ids: torch.LongTensor, attention_mask=None,
                noise_embedding: Optional[torch.Tensor] = None, target_hidden: Optional[torch.Tensor] = None,
                past_key_values=None, use_cache: bool = False, attention_fn: Optional[AttentionFunction] = None,
                **kwargs) -> torch.Tensor:
        """position_ids [b, S + Q] cover the (new) context target_hidden [b, S, n*H], then the block
        noise_embedding [b, Q, H]. attention_mask: None (all visible) or the mask `attention_fn` reads (default
        sdpa_attention: a dense mask broadcastable to [b, heads, Q, keys], keys = [cached context | context |
        block]). past_key_values (`cache=` also works): see the module docstring. Returns the block's hidden
        states [b, Q, H] after the final norm."""
        past_key_values = past_key_values if past_key_values is not None else kwargs.get("cache")
        if target_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(f"target_hidden has {target_hidden.shape[-1]} features per token, the drafter expects "
                             f"{self.fc.in_features} ({len(self.target_layer_ids)} tapped layers x "
                             f"{self.config.hidden_size})")
        x = noise_embedding.to(self.fc.weight.dtype)
        context = self.fuse_context(target_hidden)
        S = target_hidden.shape[1]
        cos, sin = self.rotary(position_ids, x.dtype)
        rope_context, rope_block = (cos[:, :S], sin[:, :S]), (cos[:, S:], sin[:, S:])
        for layer in self.layers:
            x = layer(x, context, rope_block, rope_context, attention_mask=attention_mask,
                      attention_fn=attention_fn or sdpa_attention, past_key_values=past_key_values)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor, target_head: torch.Tensor) -> torch.Tensor:
        """The drafts' logits over the target's vocabulary [..., V] from the block's hidden states [..., H]: through
        the target's LM head `target_head` (its weight [V, H]), or, with a draft vocabulary, through its rows for the
        draft ids only and -inf at every other id, so that argmax and softmax draft those ids alone (as vLLM does)."""
        if self.lm_head is None:
            return hidden @ target_head.to(hidden.dtype).t()
        scores = hidden @ self.lm_head.weight.to(hidden.dtype).t()
        logits = scores.new_full((*scores.shape[:-1], target_head.shape[0]), float("-inf"))
        logits[..., torch.arange(scores.shape[-1], device=scores.device) + self.d2t] = scores
        return logits

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: Optional[list[int]] = None, temperature: float = 0.0,
                      mask_token_id: Optional[int] = None, acceptance_lengths: Optional[list[int]] = None,
                      **kwargs) -> torch.LongTensor:
        """Speculative decoding of one sequence ([1, N] input_ids) with `target`; returns [1, N + new] ids.

        Each step drafts a block, verifies it with one target forward and keeps the longest prefix that equals
        the target's own choice (argmax, or its sample at temperature > 0), plus the target's next token: the
        output is the target's. Appends each step's acceptance length to `acceptance_lengths` if given: 1 + the
        drafts the target accepted, as z-lab/dflash counts it (also on the last step, where a stop token or
        max_new_tokens may cut the output short)."""
        from transformers import DynamicCache

        self.eval()
        mask_id = self.mask_token_id if mask_token_id is None else mask_token_id
        if mask_id is None:
            raise ValueError("no mask_token_id: set dflash_config.mask_token_id or pass mask_token_id")
        stops = set(stop_token_ids or [])
        device, B = input_ids.device, self.block_size
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        cache_kw = cache_keyword(type(target))
        n_prompt = input_ids.shape[1]

        out = target(input_ids, use_cache=True, output_hidden_states=True, **{cache_kw: target_cache})
        context = tap_layers(out.hidden_states, self.target_layer_ids)
        tokens = input_ids[0].tolist() + [int(sample(out.logits[:, -1], temperature)[0])]
        while len(tokens) - n_prompt < max_new_tokens and tokens[-1] not in stops:
            start = len(tokens) - 1  # the anchor: committed, not yet seen by the target
            block = torch.tensor([[tokens[-1]] + [mask_id] * (B - 1)], device=device)
            positions = torch.arange(draft_cache.get_seq_length(), start + B, device=device)[None]
            hidden = self(position_ids=positions, noise_embedding=embed(block), target_hidden=context,
                          past_key_values=draft_cache, use_cache=True)
            block[:, 1:] = sample(self.logits(hidden[:, 1:], head.weight), temperature)

            out = target(block, position_ids=torch.arange(start, start + B, device=device)[None], use_cache=True,
                         output_hidden_states=True, **{cache_kw: target_cache})
            choice = sample(out.logits, temperature)[0]
            accepted = int((block[0, 1:] == choice[:-1]).long().cumprod(0).sum())
            new = block[0, 1:accepted + 1].tolist() + [int(choice[accepted])]
            for i, t in enumerate(new):
                if t in stops:
                    new = new[:i + 1]
                    break
            tokens += new
            crop_cache(target_cache, start + accepted + 1)
            context = tap_layers(out.hidden_states, self.target_layer_ids)[:, :accepted + 1]
            if acceptance_lengths is not None:
                acceptance_lengths.append(1 + accepted)
        return torch.tensor([tokens[:n_prompt + max_new_tokens]], device=device)


__all__ = ["DFlashDraftModel", "build_target_layer_ids", "cache_keyword", "crop_cache", "sdpa_attention",
           "tap_layers"]
