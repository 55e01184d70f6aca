"""The DFlash drafter: a few Qwen3-style decoder layers that draft a whole block of tokens in one parallel pass.

Reading guide (one block, eval):

    context  [b, S, n*H]  tapped target states of the tokens before the anchor
        -> fc -> hidden_norm                       (fuse_context)
    block    [b, Q, H]    target embeddings of [anchor, MASK, MASK, ...]
        -> L x (pre-norm attention + SwiGLU MLP)   queries from the block only;
                                                   keys/values = k/v_proj(context) ++ k/v_proj(block)
        -> norm -> [b, Q, H]                       the caller applies the target's frozen LM head

Positions are absolute and shared with the target: context token t sits at position t, block slot k at anchor + k.
Training packs many blocks into one sequence of queries and passes a mask (dense bool or FlexAttention BlockMask)
so that every block sees the context strictly before its anchor and its own slots, never another block.

The saved folder is the public DFlash checkpoint format (config.json + model.safetensors + the remote-code module
dflash.py), loadable by SGLang, vLLM and `AutoModel.from_pretrained(DIR, trust_remote_code=True)`. The remote
module (dflash_train/remote/dflash.py) is a separate, self-contained implementation; tests check both compute the
same outputs from the same weights.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from dflash_train.errors import UserError
from dflash_train.provenance import write_json_atomic

ARCHITECTURE = "DFlashDraftModel"
REMOTE_MODULE = Path(__file__).resolve().parent / "remote" / "dflash.py"
FORMAT_VERSION = 1
# Special tokens that chat traffic never contains: code-repository markers of code-pretrained tokenizers
# (SmolLM2, StarCoder), then generic mask tokens. Tried in this order when the embedding table has no spare row.
UNUSED_SPECIAL_TOKENS = ("<repo_name>", "<reponame>", "<gh_stars>", "<file_sep>", "<filename>", "<|MASK|>",
                         "<mask>", "[MASK]")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq does not depend on the sequence length


def _rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 4.x spelling of the rope settings: None for plain RoPE, else everything but the theta."""
    if rope.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope.items() if k != "rope_theta"}


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: dict[str, Any]  # transformers' rope settings, incl. rope_type and rope_theta
    max_position_embeddings: int
    vocab_size: int  # the target's embedding rows (the drafter has no embedding of its own)
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    mask_token: str | None = None  # the token's text when it is a tokenizer entry (SGLang cross-checks it)
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    target: dict[str, Any] | None = None  # the target identity (dflash_train.target.target_identity)
    extra: dict[str, Any] = field(default_factory=dict)  # anything else to keep in config.json's dflash_train

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    def hf_config(self):
        """The equivalent transformers Qwen3Config (used for RoPE, so rope types behave as in transformers)."""
        from transformers import Qwen3Config

        rope = dict(self.rope_parameters)
        legacy = {"rope_theta": rope["rope_theta"], "rope_scaling": _rope_scaling(rope)}  # transformers 4.x
        return Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope, max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size, **legacy)

    def to_config_json(self, dtype: torch.dtype) -> dict[str, Any]:
        """config.json exactly as the public DFlash checkpoints write it, plus our `dflash_train` section."""
        import transformers

        rope = dict(self.rope_parameters)
        dflash_config: dict[str, Any] = {"mask_token_id": self.mask_token_id,
                                         "target_layer_ids": list(self.target_layer_ids)}
        if self.mask_token is not None:
            dflash_config["mask_token"] = self.mask_token
        dtype_name = str(dtype).removeprefix("torch.")
        return {
            "architectures": [ARCHITECTURE],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "block_size": self.block_size,
            "dflash_config": dflash_config,
            "num_target_layers": self.num_target_layers,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": self.rms_norm_eps,
            # both spellings: transformers >= 5 reads rope_parameters, 4.x (and engines pinned to it) rope_theta
            "rope_theta": rope["rope_theta"],
            "rope_scaling": _rope_scaling(rope),
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            # all full attention: engines treat full-attention DFlash layers as non-causal (bidirectional block)
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "initializer_range": self.initializer_range,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "dtype": dtype_name,
            "torch_dtype": dtype_name,
            "transformers_version": transformers.__version__,
            "dflash_train": {"format_version": FORMAT_VERSION, "target": self.target, **self.extra},
        }

    @classmethod
    def from_config_json(cls, cfg: dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        if ARCHITECTURE not in (cfg.get("architectures") or []):
            raise UserError(f"{source}: architectures is {cfg.get('architectures')!r}, not [{ARCHITECTURE!r}]: "
                            f"not a DFlash drafter")
        dflash = cfg.get("dflash_config") or {}
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size")
        missing = [k for k in required if k not in cfg] + [
            f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
        if missing:
            raise UserError(f"{source}: missing key(s) {', '.join(missing)}")
        rope = cfg.get("rope_parameters")
        if not rope:  # a transformers 4.x checkpoint
            rope = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
            rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
        extra = dict(cfg.get("dflash_train") or {})
        extra.pop("format_version", None)
        target = extra.pop("target", None)
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg["rms_norm_eps"], rope_parameters=dict(rope),
            max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
            num_target_layers=cfg.get("num_target_layers", max(dflash["target_layer_ids"]) + 1),
            target_layer_ids=list(dflash["target_layer_ids"]), mask_token_id=dflash["mask_token_id"],
            block_size=dflash.get("block_size", cfg.get("block_size", 16)), mask_token=dflash.get("mask_token"),
            initializer_range=cfg.get("initializer_range", 0.02), bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"), target=target,
            extra=extra)


# ----------------------------------------------------------------------------------------------------------------
# Mask token


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}


def resolve_mask_token_id(tokenizer, vocab_size: int, requested: int | None = None,
                          forbidden: set[int] | None = None) -> int:
    """The id whose target embedding fills the non-anchor slots of a block.

    It must be a row of the target's embedding table (`vocab_size` rows) and never the pad or EOS id: those
    appear in real text, so the drafter could not tell "predict here" from content. Default: the first reserved
    row past the tokenizer's vocabulary if the table has one (what the public Qwen3 drafters use), else a special
    token that chat traffic never uses (for SmolLM2 `<repo_name>`). `requested` (from a recipe) is checked by the
    same rules; `forbidden` adds ids to reject (e.g. the generation config's stop ids).
    """
    bad = _token_ids(getattr(tokenizer, "pad_token_id", None)) | _token_ids(
        getattr(tokenizer, "eos_token_id", None)) | set(forbidden or ())
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int):
            raise UserError(f"mask_token_id must be an integer token id, got {requested!r}")
        if not 0 <= requested < vocab_size:
            raise UserError(f"mask_token_id {requested} is not a row of the target's embedding table "
                            f"(0..{vocab_size - 1})")
        if requested in bad:
            name = tokenizer.convert_ids_to_tokens(requested) if requested < len(tokenizer) else requested
            raise UserError(f"mask_token_id {requested} ({name}) is the target's pad or EOS token; pick a token "
                            f"that never occurs in real text (a reserved row or an unused special token)")
        return requested
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    vocab = tokenizer.get_vocab()
    for token in UNUSED_SPECIAL_TOKENS:
        token_id = vocab.get(token)
        if token_id is not None and token_id < vocab_size and token_id not in bad and token not in template:
            return int(token_id)
    raise UserError(f"the target's tokenizer fills its whole embedding table ({vocab_size} rows) and has none of "
                    f"the unused special tokens {', '.join(UNUSED_SPECIAL_TOKENS)}: set mask_token_id in the "
                    f"recipe to a token that chat traffic never uses")


def default_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """n layers evenly spaced from 1 to L-3, as the reference DFlash drafters tap them (Qwen3-8B: 1,9,17,25,33)."""
    from dflash_train.target import default_layer_ids

    return default_layer_ids(num_target_layers, n)


# ----------------------------------------------------------------------------------------------------------------
# Model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary:
    """RoPE cos/sin for absolute positions, with the target's rope type and scaling (transformers' formulas).

    Not an nn.Module buffer on purpose: `model.to(bfloat16)` must not round the inverse frequencies."""

    def __init__(self, config: DrafterConfig):
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        rope_type = config.rope_parameters.get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise UserError(f"rope_type {rope_type!r} is not supported by the drafter (supported: "
                            f"{', '.join(STATIC_ROPE_TYPES)})")
        if rope_type == "default":
            d, theta = config.head_dim, config.rope_parameters["rope_theta"]
            inv_freq, self.scaling = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float) / d)), 1.0
        else:
            inv_freq, self.scaling = ROPE_INIT_FUNCTIONS[rope_type](config.hf_config(), None)
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | BlockMask | Callable | None,
           scale: float) -> torch.Tensor:
    """Attention of q [b, h, Q, d] over k/v [b, kv_heads, K, d] -> [b, Q, h*d].

    `mask`: None (all keys visible), a dense bool tensor broadcastable to [b, h, Q, K] (True = may attend), a
    FlexAttention BlockMask over the same keys, or a callable `mask(q, k, v, scale=scale) -> [b, h, Q, d]` that
    does the attention itself (the trainer's block-sparse kernel; k/v not repeated for GQA)."""
    if isinstance(mask, BlockMask):
        out = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)
    elif callable(mask):
        out = mask(q, k, v, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
    b, h, n, d = out.shape
    return out.transpose(1, 2).reshape(b, n, h * d)


class Attention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, d = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, d
        self.q_proj = nn.Linear(H, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(H, self.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(H, self.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, H, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        """k (k_norm + RoPE at each token's own position) and v, [b, kv_heads, L, d] each."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, *rope), v

    def forward(self, x: torch.Tensor, context: torch.Tensor, rope_block, rope_context, mask,
                cache: "DraftCache | None", layer: int) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.n_heads, self.head_dim)).transpose(1, 2)
        q = apply_rope(q, *rope_block)
        k_ctx, v_ctx = self.keys_values(context, rope_context)
        if cache is not None:  # the new context is committed: keep its K/V for every later draft
            k_ctx, v_ctx = cache.append(layer, k_ctx, v_ctx)
        k_blk, v_blk = self.keys_values(x, rope_block)
        k = torch.cat([k_ctx, k_blk], dim=2)
        v = torch.cat([v_ctx, v_blk], dim=2)
        return self.o_proj(attend(q, k, v, mask, self.head_dim ** -0.5))


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, context, rope_block, rope_context, mask, cache, layer: int) -> torch.Tensor:
        # the fused context is the same for every layer and is not normed again: only the block is pre-normed
        x = x + self.self_attn(self.input_layernorm(x), context, rope_block, rope_context, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftCache:
    """Context K/V per layer for incremental drafting in eval.

    A forward with a cache appends the K/V of the context it is given (newly committed tokens) for good; the
    block's K/V are used for that forward only. `crop(n)` keeps the first n context positions."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def seq_len(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, n: int) -> None:
        if n < 0 or n > self.seq_len:
            raise ValueError(f"cannot crop a draft cache of {self.seq_len} positions to {n}")
        self.keys = [None if k is None else k[:, :, :n] for k in self.keys]
        self.values = [None if v is None else v[:, :, :n] for v in self.values]


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.fc = nn.Linear(config.num_target_features * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.gradient_checkpointing = False  # recompute each layer in backward (training only) to save memory
        # Optional per-channel divisor of the tapped states (training only, `set_context_scale`); not part of the
        # checkpoint format: save_pretrained folds it into fc, so exported weights compute the same function.
        self.register_buffer("context_scale", None, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)

    # -- construction -------------------------------------------------------------------------------------------

    @classmethod
    def from_target(cls, target_config, num_layers: int = 5, block_size: int = 16,
                    target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                    tokenizer=None, target_identity: dict[str, Any] | None = None) -> "DFlashDrafter":
        """A freshly initialised drafter for a target (its transformers config): hidden size, heads, head_dim,
        MLP width, rope settings and norm eps are the target's."""
        cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise UserError(f"target hidden_act {cfg.hidden_act!r}: the DFlash drafter uses SwiGLU (silu) only")
        L = cfg.num_hidden_layers
        ids = list(target_layer_ids) if target_layer_ids is not None else default_target_layer_ids(L, num_layers)
        bad_ids = [i for i in ids if not (isinstance(i, int) and 0 <= i < L)]
        if bad_ids or len(set(ids)) != len(ids) or not ids:
            raise UserError(f"target_layer_ids {ids} must be distinct layer indices of the {L}-layer target "
                            f"(0..{L - 1})")
        if num_layers < 1 or block_size < 2:
            raise UserError(f"a drafter needs num_layers >= 1 and block_size >= 2, got {num_layers}, {block_size}")
        vocab_size = cfg.vocab_size
        forbidden = _token_ids(getattr(cfg, "eos_token_id", None)) | _token_ids(getattr(cfg, "pad_token_id", None))
        mask_token = None
        if tokenizer is not None:
            mask_token_id = resolve_mask_token_id(tokenizer, vocab_size, mask_token_id, forbidden)
            if mask_token_id < len(tokenizer):
                mask_token = tokenizer.convert_ids_to_tokens(mask_token_id)
        elif mask_token_id is None:
            raise UserError("from_target needs the target's tokenizer or an explicit mask_token_id")
        elif not 0 <= mask_token_id < vocab_size or mask_token_id in forbidden:
            raise UserError(f"mask_token_id {mask_token_id} must be a row of the target's embedding table "
                            f"(0..{vocab_size - 1}) and not its pad/EOS id ({sorted(forbidden)})")
        rope = getattr(cfg, "rope_parameters", None)
        if not rope:  # transformers 4.x style config
            rope = dict(getattr(cfg, "rope_scaling", None) or {"rope_type": "default"})
            rope["rope_theta"] = getattr(cfg, "rope_theta", 10000.0)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        config = DrafterConfig(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim, rms_norm_eps=float(cfg.rms_norm_eps), rope_parameters=dict(rope),
            max_position_embeddings=cfg.max_position_embeddings, vocab_size=vocab_size, num_target_layers=L,
            target_layer_ids=ids, mask_token_id=int(mask_token_id), block_size=block_size, mask_token=mask_token,
            bos_token_id=getattr(cfg, "bos_token_id", None), eos_token_id=getattr(cfg, "eos_token_id", None),
            pad_token_id=getattr(cfg, "pad_token_id", None), target=target_identity)
        return cls(config)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: str | torch.device = "cpu") -> "DFlashDrafter":
        return load_drafter(path, dtype=dtype, device=device)

    def set_context_scale(self, scale: torch.Tensor | None) -> None:
        """Divide the tapped states by `scale` [n*H] (> 0) before fc. The target's tapped states carry a few huge,
        nearly constant channels; dividing every channel by its RMS over real data lets fc start from inputs of
        unit scale. Exact to fold into fc (fc(x / s) = (W / s) x), which save_pretrained does."""
        if scale is not None:
            scale = scale.detach().float().reshape(-1)
            if scale.numel() != self.fc.in_features or not bool((scale > 0).all()) or not bool(scale.isfinite().all()):
                raise ValueError(f"context scale must be {self.fc.in_features} positive finite values")
            scale = scale.to(self.fc.weight.device)
        self.context_scale = scale

    def init_from_target(self, layers: list[dict[str, torch.Tensor]], final_norm: torch.Tensor) -> list[str]:
        """Start from the target instead of random weights: drafter layer i takes the weights of `layers[i]` (the
        target's top decoder layers, keys as in the target's layer: self_attn.q_proj.weight, ...), `norm` the
        target's final norm, `hidden_norm` the first copied layer's input norm, and fc passes the deepest tapped
        layer through unchanged (fused context = that layer's output, which is the first copied layer's input).
        q_norm/k_norm start at 1 where the target has none. Returns the names of the tensors set."""
        if len(layers) != len(self.layers):
            raise ValueError(f"{len(layers)} target layers for a {len(self.layers)}-layer drafter")
        set_names = []
        with torch.no_grad():
            for i, (layer, weights) in enumerate(zip(self.layers, layers)):
                own = dict(layer.named_parameters())
                for name, param in own.items():
                    if name in weights:
                        if tuple(weights[name].shape) != tuple(param.shape):
                            raise UserError(f"target layer tensor {name} has shape {tuple(weights[name].shape)}, "
                                            f"the drafter's is {tuple(param.shape)}")
                        param.copy_(weights[name])
                    elif name in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                        param.fill_(1.0)
                    else:
                        raise UserError(f"the target's layer has no {name}: cannot initialise the drafter from it")
                    set_names.append(f"layers.{i}.{name}")
            self.norm.weight.copy_(final_norm)
            self.hidden_norm.weight.copy_(layers[0]["input_layernorm.weight"])
            H = self.config.hidden_size
            deepest = max(range(self.config.num_target_features), key=lambda j: self.config.target_layer_ids[j])
            scale = torch.ones(H) if self.context_scale is None else self.context_scale[deepest * H:(deepest + 1) * H]
            self.fc.weight.zero_()
            self.fc.weight[:, deepest * H:(deepest + 1) * H] = torch.diag(scale.to(self.fc.weight.device))
        return set_names + ["norm.weight", "hidden_norm.weight", "fc.weight"]

    # -- forward ------------------------------------------------------------------------------------------------

    def fuse_context(self, context: torch.Tensor) -> torch.Tensor:
        """Tapped target states [b, S, n*H] -> context vectors [b, S, H]."""
        context = context.to(self.fc.weight.dtype)
        if self.context_scale is not None:
            context = context / self.context_scale.to(context.dtype)
        return self.hidden_norm(self.fc(context))

    def forward(self, block_embeds: torch.Tensor, context: torch.Tensor, position_ids: torch.Tensor,
                context_position_ids: torch.Tensor, attention_mask: torch.Tensor | BlockMask | Callable | None = None,
                cache: DraftCache | None = None) -> torch.Tensor:
        """block_embeds [b, Q, H] (target embeddings of the block tokens), context [b, S, n*H] (raw tapped
        states), position_ids [b, Q] (anchor + k), context_position_ids [b, S]; with `cache`, `context` holds only
        the newly committed tokens and the mask (if any) spans [cached context | new context | block].
        Returns the block's hidden states [b, Q, H] after the final norm."""
        if context.shape[-1] != self.fc.in_features:
            raise ValueError(f"context has {context.shape[-1]} features per token, the drafter expects "
                             f"{self.fc.in_features} ({self.config.num_target_features} tapped layers x "
                             f"{self.config.hidden_size})")
        x = block_embeds.to(self.fc.weight.dtype)
        ctx = self.fuse_context(context)
        rope_block = self.rotary(position_ids, x.dtype)
        rope_context = self.rotary(context_position_ids, x.dtype)
        for i, layer in enumerate(self.layers):
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(layer, x, ctx, rope_block, rope_context, attention_mask, None, i, use_reentrant=False)
            else:
                x = layer(x, ctx, rope_block, rope_context, attention_mask, cache, i)
        return self.norm(x)

    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- checkpoint ---------------------------------------------------------------------------------------------

    def save_pretrained(self, out_dir: str | Path) -> Path:
        """Write the public DFlash format: config.json, model.safetensors, dflash.py (remote code)."""
        from safetensors.torch import save_file

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        dtype = self.fc.weight.dtype
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        if self.context_scale is not None:  # fold x / s into fc: the public format has no place for s
            folded = self.fc.weight.detach().float().cpu() / self.context_scale.cpu()[None, :]
            tensors["fc.weight"] = folded.to(dtype).contiguous()
        tmp = out / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(out / "model.safetensors")
        shutil.copyfile(REMOTE_MODULE, out / "dflash.py")
        write_json_atomic(out / "config.json", self.config.to_config_json(dtype))
        return out


def expected_tensor_names(num_layers: int) -> list[str]:
    names = []
    for i in range(num_layers):
        p = f"layers.{i}."
        names += [p + f"self_attn.{m}_proj.weight" for m in "qkvo"]
        names += [p + f"self_attn.{m}_norm.weight" for m in "qk"]
        names += [p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    return names + ["norm.weight", "fc.weight", "hidden_norm.weight"]


def load_drafter(path: str | Path, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> DFlashDrafter:
    """Load a drafter folder written by `save_pretrained` (or any public DFlash checkpoint of this architecture).
    dtype None keeps the stored dtype."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_file, weights_file = folder / "config.json", folder / "model.safetensors"
    for f in (config_file, weights_file):
        if not f.exists():
            raise UserError(f"{f} is missing: {folder} is not a drafter folder (save_pretrained writes it)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{config_file} is not valid JSON: {err}") from None
    config = DrafterConfig.from_config_json(raw, str(config_file))
    state = load_file(str(weights_file))
    expected = set(expected_tensor_names(config.num_hidden_layers))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise UserError(f"{weights_file}: tensors do not match the config "
                        f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    model = DFlashDrafter(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise UserError(f"{weights_file}: {str(err).splitlines()[0]} (shapes do not match config.json)") from None
    stored = getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype") or "float32"), torch.float32)
    return model.to(device=device, dtype=dtype or stored)


# ----------------------------------------------------------------------------------------------------------------
# Masks: which keys [context | blocks] each block query may attend to


def block_visibility(context_position_ids: torch.Tensor, anchor_positions: torch.Tensor, block_size: int,
                     context_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Dense mask for N blocks packed as queries [b, N*B] over keys [context S | blocks N*B].

    context_position_ids [b, S] (absolute positions of the context tokens), anchor_positions [b, N],
    context_valid [b, S] (False = padding). A query of block j sees context tokens at positions < anchor_j and
    the B slots of block j. Returns bool [b, 1, N*B, S + N*B], True = may attend."""
    b, n = anchor_positions.shape
    q_block = torch.arange(n * block_size, device=anchor_positions.device) // block_size  # [Q]
    q_anchor = anchor_positions[:, q_block]  # [b, Q]
    sees_context = context_position_ids[:, None, :] < q_anchor[:, :, None]  # [b, Q, S]
    if context_valid is not None:
        sees_context = sees_context & context_valid[:, None, :]
    sees_block = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [b, Q, Q]
    return torch.cat([sees_context, sees_block], dim=-1)[:, None]


def block_visibility_flex(context_position_ids: torch.Tensor, anchor_positions: torch.Tensor, block_size: int,
                          context_valid: torch.Tensor | None = None) -> BlockMask:
    """The same rule as `block_visibility`, as a FlexAttention BlockMask (sparse: skips invisible tiles)."""
    b, n = anchor_positions.shape
    S = context_position_ids.shape[1]
    valid = torch.ones_like(context_position_ids, dtype=torch.bool) if context_valid is None else context_valid

    def mask_mod(batch, head, q_idx, kv_idx):
        q_block = q_idx // block_size
        ctx_idx = torch.clamp(kv_idx, max=max(S - 1, 0))
        sees_context = (context_position_ids[batch, ctx_idx] < anchor_positions[batch, q_block]) & \
            valid[batch, ctx_idx]
        sees_block = (kv_idx - S) // block_size == q_block
        return torch.where(kv_idx < S, sees_context, sees_block)

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=n * block_size, KV_LEN=S + n * block_size,
                             device=anchor_positions.device)


def parameter_count_formula(config: DrafterConfig) -> tuple[int, str]:
    """Parameters without embedding and LM head, and the formula they follow."""
    H, I, h, kv, d = (config.hidden_size, config.intermediate_size, config.num_attention_heads,
                      config.num_key_value_heads, config.head_dim)
    L, n = config.num_hidden_layers, config.num_target_features
    per_layer = 2 * H * h * d + 2 * H * kv * d + 2 * d + 3 * H * I + 2 * H
    total = L * per_layer + n * H * H + 2 * H
    formula = (f"L*(2*H*h*d + 2*H*kv*d + 2*d + 3*H*I + 2*H) + n*H^2 + 2*H with L={L}, H={H}, h={h}, kv={kv}, "
               f"d={d}, I={I}, n={n} = {total:,}")
    return total, formula


__all__ = ["DrafterConfig", "DFlashDrafter", "DraftCache", "load_drafter", "resolve_mask_token_id", "attend",
           "block_visibility", "block_visibility_flex", "expected_tensor_names", "parameter_count_formula",
           "default_target_layer_ids"]
