"""DFlash draft model: remote code for `AutoModel.from_pretrained(DIR, trust_remote_code=True)`.

Self-contained (torch + transformers only). Written by dflash-train; the same architecture as the public DFlash
drafters (z-lab/dflash), so SGLang and vLLM load the folder with their own DFlash implementations.

A block of B tokens [anchor, MASK, ..., MASK] is drafted in one pass. Every layer attends from the block's
queries to keys/values computed by the layer's own k_proj/v_proj from (a) the target's tapped hidden states of
the committed context, fused by `fc` + `hidden_norm`, and (b) the block itself. Positions are absolute and
shared with the target. The drafter has no embedding and no LM head: the target's are used.

    model = AutoModel.from_pretrained(DIR, trust_remote_code=True, dtype=torch.bfloat16)
    out = model.spec_generate(target=target, input_ids=ids, max_new_tokens=256, stop_token_ids=[eos])
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default tapped layers: evenly spaced from 1 to L-3 (Qwen3-8B, 5 layers: 1, 9, 17, 25, 33)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def extract_context_feature(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of the tapped decoder layers (hidden_states[0] is the embedding output)."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def sample(logits: torch.Tensor, temperature: float = 0.0) -> torch.Tensor:
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(probs.shape[:-1])


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of a transformers Cache (crop's positive form is gone in v5; its
    negative form removes that many positions in both v4 and v5)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _cache_kwargs(model: nn.Module, cache) -> dict:
    """transformers renamed `past_key_values` to `cache` (5.x); pass the cache under the name `model` takes."""
    return {"cache": cache} if "cache" in inspect.signature(model.forward).parameters else {
        "past_key_values": cache}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        bias = getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None,
                past_key_values=None):
        bsz, q_len = hidden_states.shape[:2]
        ctx_len = target_hidden.shape[1]
        cos, sin = position_embeddings  # over [context | block]
        q = self.q_norm(self.q_proj(hidden_states).view(bsz, q_len, -1, self.head_dim)).transpose(1, 2)
        q = _rope(q, cos[:, ctx_len:], sin[:, ctx_len:])
        both = torch.cat([target_hidden, hidden_states], dim=1)
        k = self.k_norm(self.k_proj(both).view(bsz, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(both).view(bsz, ctx_len + q_len, -1, self.head_dim).transpose(1, 2)
        k = _rope(k, cos, sin)
        if past_key_values is not None:  # the caller crops the block's entries afterwards
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            attention_mask = attention_mask.to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.head_dim ** -0.5,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, target_hidden, position_embeddings, attention_mask=None,
                past_key_values=None):
        residual = hidden_states
        hidden_states = self.self_attn(self.input_layernorm(hidden_states), target_hidden, position_embeddings,
                                       attention_mask, past_key_values)
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(Qwen3PreTrainedModel):
    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash_config = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash_config.get("target_layer_ids") or build_target_layer_ids(
            config.num_target_layers, config.num_hidden_layers))
        self.mask_token_id = dflash_config.get("mask_token_id")
        self.block_size = int(dflash_config.get("block_size", getattr(config, "block_size", 16)))
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def forward(self, position_ids: torch.LongTensor, attention_mask: Optional[torch.Tensor] = None,
                noise_embedding: Optional[torch.Tensor] = None, target_hidden: Optional[torch.Tensor] = None,
                past_key_values=None, use_cache: bool = False, **kwargs) -> torch.Tensor:
        """position_ids [b, S+Q] cover the new context (target_hidden [b, S, n*H]) then the block
        (noise_embedding [b, Q, H]). attention_mask: None (all visible) or broadcastable to [b, heads, Q, keys].
        With past_key_values (a transformers Cache; `cache=` also works), the context and block K/V are appended:
        crop it to the committed length afterwards (crop_cache). Returns the block's hidden states [b, Q, H]
        after the final norm."""
        past_key_values = past_key_values if past_key_values is not None else kwargs.get("cache")
        hidden_states = noise_embedding.to(self.fc.weight.dtype)
        target_hidden = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, target_hidden, position_embeddings, attention_mask,
                                  past_key_values)
        return self.norm(hidden_states)

    @torch.inference_mode()
    def spec_generate(self, target: nn.Module, input_ids: torch.LongTensor, max_new_tokens: int,
                      stop_token_ids: Optional[list[int]] = None, temperature: float = 0.0,
                      mask_token_id: Optional[int] = None, acceptance_lengths: Optional[list[int]] = None,
                      **kwargs) -> torch.LongTensor:
        """Speculative decoding of one sequence ([1, N] input_ids) with `target`; returns [1, N + new] ids.

        Each step drafts a block, verifies it with one target forward and keeps the longest prefix that equals
        the target's own choice (argmax, or its sample at temperature > 0), plus the target's next token: the
        output is the target's. Appends tokens committed per step to `acceptance_lengths` if given."""
        from transformers import DynamicCache

        self.eval()
        mask_id = self.mask_token_id if mask_token_id is None else mask_token_id
        if mask_id is None:
            raise ValueError("no mask_token_id: set dflash_config.mask_token_id or pass mask_token_id")
        stops = set(stop_token_ids or [])
        device, B = input_ids.device, self.block_size
        embed, head = target.get_input_embeddings(), target.get_output_embeddings()
        target_cache, draft_cache = DynamicCache(), DynamicCache()
        n_prompt = input_ids.shape[1]

        out = target(input_ids, use_cache=True, output_hidden_states=True, **_cache_kwargs(target, target_cache))
        context = extract_context_feature(out.hidden_states, self.target_layer_ids)
        tokens = input_ids[0].tolist() + [int(sample(out.logits[:, -1], temperature)[0])]
        while len(tokens) - n_prompt < max_new_tokens and tokens[-1] not in stops:
            start = len(tokens) - 1  # the anchor: committed, not yet seen by the target
            block = torch.tensor([[tokens[-1]] + [mask_id] * (B - 1)], device=device)
            positions = torch.arange(draft_cache.get_seq_length(), start + B, device=device)[None]
            hidden = self(position_ids=positions, noise_embedding=embed(block), target_hidden=context,
                          past_key_values=draft_cache, use_cache=True)
            crop_cache(draft_cache, start)
            block[:, 1:] = sample(head(hidden[:, 1:]), temperature)

            out = target(block, position_ids=torch.arange(start, start + B, device=device)[None], use_cache=True,
                         output_hidden_states=True, **_cache_kwargs(target, target_cache))
            choice = sample(out.logits, temperature)[0]
            accepted = int((block[0, 1:] == choice[:-1]).long().cumprod(0).sum())
            new = block[0, 1:accepted + 1].tolist() + [int(choice[accepted])]
            for i, t in enumerate(new):
                if t in stops:
                    new = new[:i + 1]
                    break
            tokens += new
            crop_cache(target_cache, start + accepted + 1)
            context = extract_context_feature(out.hidden_states, self.target_layer_ids)[:, :accepted + 1]
            if acceptance_lengths is not None:
                acceptance_lengths.append(len(new))
        return torch.tensor([tokens[:n_prompt + max_new_tokens]], device=device)


__all__ = ["DFlashDraftModel", "build_target_layer_ids", "crop_cache", "extract_context_feature", "sample"]
