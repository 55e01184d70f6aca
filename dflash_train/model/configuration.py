"""A drafter's config.json, typed: both directions, the tensor names it implies, the mask-token rule, the
reference's default taps, and the construction of a new drafter's config from its target's.

config.json is the public DFlash checkpoint format, as the reference drafters write it (SGLang and vLLM read it;
vLLM does not run our remote code) plus a `dflash_train` section: the format version, the identity of the target
the drafter was trained for (dflash_train.target.TargetIdentity as JSON) and anything else the trainer keeps.
`DFlashConfig.to_config_json` is the only writer and `from_config_json` the only reader of that file; the model
module itself reads the same file through transformers' Qwen3Config (`qwen3_config` builds that object here).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch

from dflash_train.errors import UserError
from dflash_train.target import Features, TargetIdentity, TargetRecord, check_layer_ids, layer_ids_problem

ARCHITECTURE = "DFlashDraftModel"
FORMAT_VERSION = 1
# Special tokens that chat traffic never contains: code-repository markers of code-pretrained tokenizers
# (SmolLM2, StarCoder), then generic mask tokens. Tried in this order when the embedding table has no spare row.
UNUSED_SPECIAL_TOKENS = ("<repo_name>", "<reponame>", "<gh_stars>", "<file_sep>", "<filename>", "<|MASK|>",
                         "<mask>", "[MASK]")
# The tensors of one decoder layer with their shapes, Qwen3's names (the checkpoint contract; the target's layers use
# the same names, which is what drafter.init: target copies by). Shapes in the dimensions `expected_tensor_shapes`
# names: H hidden, I intermediate, d head_dim, q / kv the query / key-value widths (heads x d).
LAYER_TENSORS = {"self_attn.q_proj.weight": ("q", "H"), "self_attn.k_proj.weight": ("kv", "H"),
                 "self_attn.v_proj.weight": ("kv", "H"), "self_attn.o_proj.weight": ("H", "q"),
                 "self_attn.q_norm.weight": ("d",), "self_attn.k_norm.weight": ("d",),
                 "mlp.gate_proj.weight": ("I", "H"), "mlp.up_proj.weight": ("I", "H"),
                 "mlp.down_proj.weight": ("H", "I"), "input_layernorm.weight": ("H",),
                 "post_attention_layernorm.weight": ("H",)}
# ...and the drafter's own tensors outside the layers (nH: the tapped features, num_target_features x H)
DRAFTER_TENSORS = {"norm.weight": ("H",), "fc.weight": ("H", "nH"), "hidden_norm.weight": ("H",)}
# ...and those of a draft vocabulary (config.json's `draft_vocab_size` Nd, vLLM's layout, as EAGLE-3 ships it): the
# target LM head's rows for the Nd ids the drafter drafts, and d2t, each row's offset to its target id
DRAFT_VOCAB_TENSORS = {"lm_head.weight": ("Nd", "H"), "d2t": ("Nd",)}


# The largest value each dimension of a drafter's config may take: the largest public models' with room to spare
# (hidden 16384, MLP 53248, 128 heads, head_dim 256, 126 layers, 262k-token vocabularies, 10M positions). A config
# past them is broken or hostile: building its tensor-name table or its model would allocate without bound, so
# `from_config_json` refuses it before anything is built (the weights then bound the rest: `check_weights_fit_config`).
MAX_DIMENSIONS = {"hidden_size": 1 << 16, "intermediate_size": 1 << 18, "num_hidden_layers": 1 << 10,
                  "num_attention_heads": 1 << 10, "num_key_value_heads": 1 << 10, "head_dim": 1 << 12,
                  "vocab_size": 1 << 21, "max_position_embeddings": 1 << 26, "num_target_layers": 1 << 10,
                  "block_size": 1 << 10}

HfConfig = dict[str, Any]
"""A model's config.json as Hugging Face writes and reads it: transformers' keys for its model type, and whatever
else a tool put there (a drafter's: `to_config_json`)."""

RopeParameters = dict[str, Any]
"""transformers' rope settings (config.json's `rope_parameters`): rope_type, rope_theta and that type's own keys."""


class DflashSection(TypedDict, total=False):
    """config.json's `dflash_config`, as the reference drafters write it."""
    mask_token_id: int
    target_layer_ids: list[int]
    mask_token: str  # where the mask token is a tokenizer entry
    block_size: int  # some write it here rather than at the top level


def expected_tensor_names(num_layers: int) -> list[str]:
    """Every tensor of a drafter with `num_layers` layers: no embedding, no LM head (the target's are used)."""
    return [f"layers.{i}.{name}" for i in range(num_layers) for name in LAYER_TENSORS] + list(DRAFTER_TENSORS)


def expected_tensor_shapes(config: "DFlashConfig") -> dict[str, tuple[int, ...]]:
    """The shape of every tensor `expected_tensor_names` lists, as the model module builds it from `config` (checked
    against the module by tests/test_checkpoint.py); what push and load hold a folder's weights against."""
    H, d = config.hidden_size, config.head_dim
    dims = {"H": H, "I": config.intermediate_size, "d": d, "q": config.num_attention_heads * d,
            "kv": config.num_key_value_heads * d, "nH": config.num_target_features * H, "Nd": config.draft_vocab_size}
    tables = {**{f"layers.{i}.{name}": shape for i in range(config.num_hidden_layers)
                 for name, shape in LAYER_TENSORS.items()}, **DRAFTER_TENSORS,
              **(DRAFT_VOCAB_TENSORS if config.draft_vocab_size else {})}
    return {name: tuple(dims[dim] for dim in shape) for name, shape in tables.items()}


def _rope_scaling(rope: RopeParameters) -> RopeParameters | None:
    """transformers 4.x spelling of the rope settings: None for plain RoPE, else everything but the theta."""
    if rope.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope.items() if k != "rope_theta"}


def _rope_parameters(cfg: Any) -> RopeParameters:
    """transformers >= 5 rope settings of a config (object or config.json dict), from the 4.x spelling if need be."""
    get = cfg.get if isinstance(cfg, dict) else lambda key, default=None: getattr(cfg, key, default)
    rope = get("rope_parameters")
    if not rope:  # a transformers 4.x config
        rope = dict(get("rope_scaling") or {"rope_type": "default"})
        rope["rope_theta"] = get("rope_theta", 10000.0)
    return dict(rope)


def _unbuildable(cfg: HfConfig, dflash: DflashSection, block_size: Any, rope: RopeParameters) -> str | None:
    """What keeps a config.json from being built, naming the key (None: nothing), checked before anything is built
    from it: every dimension an integer within MAX_DIMENSIONS (head_dim and num_target_layers may be left out),
    whole key-value head groups, the taps a list of layer ids, a positive finite norm eps and rope theta."""
    for key, top in MAX_DIMENSIONS.items():
        value, low = block_size if key == "block_size" else cfg.get(key), 2 if key == "block_size" else 1
        if value is None and key in ("head_dim", "num_target_layers"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            return f"{key} is {value!r}, not an integer from {low} to {top}"
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if heads % kv_heads:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
    if cfg.get("head_dim") is None and cfg["hidden_size"] < heads:
        return f"hidden_size {cfg['hidden_size']} is smaller than num_attention_heads {heads} (and no head_dim)"
    ids = dflash["target_layer_ids"]
    if not (isinstance(ids, list) and 1 <= len(ids) <= MAX_DIMENSIONS["num_target_layers"]
            and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        return (f"dflash_config.target_layer_ids is {ids!r}, not a list of 1 to "
                f"{MAX_DIMENSIONS['num_target_layers']} layer ids")
    for key, value in (("rms_norm_eps", cfg["rms_norm_eps"]), ("rope_theta", rope.get("rope_theta"))):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            return f"{key} is {value!r}, not a positive finite number"
    return None


@dataclass
class DFlashConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_parameters: RopeParameters
    max_position_embeddings: int
    vocab_size: int  # the target's embedding rows (the drafter has no embedding of its own)
    num_target_layers: int | None  # None: not recorded (speculators' layout); the target it meets decides
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    mask_token: str | None = None  # the token's text when it is a tokenizer entry (SGLang cross-checks it)
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    target: TargetRecord | None = None  # the target identity as written
    # a draft vocabulary: the drafter drafts only this many of the target's ids, with its own copy of the target
    # head's rows for them (DRAFT_VOCAB_TENSORS); None: the whole vocabulary, through the target's head
    draft_vocab_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # anything else to keep in config.json's dflash_train

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    def features(self):
        """What the drafter reads (dflash_train.target.Features): for check_fits against a store or a target."""
        return Features(TargetIdentity.from_dict(self.target), tuple(self.target_layer_ids), self.hidden_size)

    def target_problems(self, num_layers: int, embedding_rows: int, forbidden_mask_ids: set[int]) -> list[str]:
        """What keeps this drafter from reading a target with `num_layers` layers and an embedding table of
        `embedding_rows` rows whose stop and pad ids are `forbidden_mask_ids`, one phrase per mismatch (empty: it
        fits). Its taps (the one layer rule), the layer count it was made for, its vocabulary and its mask token;
        target identity, tapped layers and hidden size are `check_fits`'s."""
        problems = []
        if problem := layer_ids_problem(list(self.target_layer_ids), num_layers):
            problems.append(problem)
        if self.num_target_layers is not None and self.num_target_layers != num_layers:
            problems.append(f"it was made for a {self.num_target_layers}-layer target, this one has {num_layers} "
                            f"layers")
        if self.vocab_size != embedding_rows:
            problems.append(f"vocab size {self.vocab_size} != the target's embedding rows {embedding_rows}")
        if problem := mask_token_problem(self.mask_token_id, embedding_rows, forbidden_mask_ids):
            problems.append(problem)
        return problems

    def qwen3_config(self):
        """The transformers Qwen3Config the model module is built from: what AutoConfig reads from config.json."""
        from transformers import Qwen3Config

        return Qwen3Config.from_dict(self.to_config_json(torch.float32))

    def to_config_json(self, dtype: torch.dtype) -> HfConfig:
        """config.json exactly as the public DFlash checkpoints write it, plus our `dflash_train` section."""
        import transformers

        rope = dict(self.rope_parameters)
        dflash_config: DflashSection = {"mask_token_id": self.mask_token_id,
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
            **({"draft_vocab_size": self.draft_vocab_size} if self.draft_vocab_size else {}),
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
    def from_config_json(cls, cfg: HfConfig, source: str = "config.json") -> "DFlashConfig":
        if ARCHITECTURE not in (cfg.get("architectures") or []):
            raise UserError(f"{source}: architectures is {cfg.get('architectures')!r}, not [{ARCHITECTURE!r}]: "
                            f"not a DFlash drafter")
        for key in ("dflash_config", "dflash_train", "rope_parameters", "rope_scaling"):
            if cfg.get(key) is not None and not isinstance(cfg[key], dict):
                raise UserError(f"{source}: {key} is {cfg[key]!r}, not a JSON object")
        dflash = cfg.get("dflash_config") or {}
        required = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size")
        missing = [k for k in required if k not in cfg] + [
            f"dflash_config.{k}" for k in ("mask_token_id", "target_layer_ids") if k not in dflash]
        if missing:
            raise UserError(f"{source}: missing key(s) {', '.join(missing)}")
        extra = dict(cfg.get("dflash_train") or {})
        extra.pop("format_version", None)
        target = extra.pop("target", None)
        rope, block_size = _rope_parameters(cfg), dflash.get("block_size", cfg.get("block_size", 16))
        if problem := _unbuildable(cfg, dflash, block_size, rope):
            raise UserError(f"{source}: {problem}: not a drafter config this project can read")
        draft_vocab = cfg.get("draft_vocab_size")
        if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int)
                                        or not 1 <= draft_vocab <= cfg["vocab_size"]):
            raise UserError(f"{source}: draft_vocab_size is {draft_vocab!r}, not an integer from 1 to vocab_size "
                            f"{cfg['vocab_size']}: not a drafter config this project can read")
        return cls(
            hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg["rms_norm_eps"], rope_parameters=rope,
            max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
            num_target_layers=cfg.get("num_target_layers", max(dflash["target_layer_ids"]) + 1),
            target_layer_ids=list(dflash["target_layer_ids"]), mask_token_id=dflash["mask_token_id"],
            block_size=block_size, mask_token=dflash.get("mask_token"),
            initializer_range=cfg.get("initializer_range", 0.02), bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"), pad_token_id=cfg.get("pad_token_id"), target=target,
            draft_vocab_size=None if draft_vocab == cfg["vocab_size"] else draft_vocab, extra=extra)

    @classmethod
    def from_target(cls, target_config, num_layers: int = 5, block_size: int = 16,
                    target_layer_ids: list[int] | None = None, mask_token_id: int | None = None,
                    tokenizer=None, target_identity: TargetRecord | None = None) -> "DFlashConfig":
        """A new drafter's config for a target (its transformers config): hidden size, heads, head_dim, MLP width,
        rope settings and norm eps are the target's; the tapped layers default to the reference's rule."""
        cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise UserError(f"target hidden_act {cfg.hidden_act!r}: the DFlash drafter uses SwiGLU (silu) only")
        L = cfg.num_hidden_layers
        ids = list(target_layer_ids) if target_layer_ids is not None else default_layer_ids(L, num_layers)
        check_layer_ids(ids, L)
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
            raise UserError("a new drafter needs the target's tokenizer or an explicit mask_token_id")
        elif problem := mask_token_problem(mask_token_id, vocab_size, forbidden):
            raise UserError(problem)
        return cls(
            hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=num_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            rms_norm_eps=float(cfg.rms_norm_eps), rope_parameters=_rope_parameters(cfg),
            max_position_embeddings=cfg.max_position_embeddings, vocab_size=vocab_size, num_target_layers=L,
            target_layer_ids=ids, mask_token_id=int(mask_token_id), block_size=block_size, mask_token=mask_token,
            bos_token_id=getattr(cfg, "bos_token_id", None), eos_token_id=getattr(cfg, "eos_token_id", None),
            pad_token_id=getattr(cfg, "pad_token_id", None), target=target_identity)


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """The reference's default taps (`build_target_layer_ids`): one layer at L // 2, else n layers evenly spaced
    from layer 1 to L-3, round(1 + i*(L-4)/(n-1)) (Qwen3-8B: 1,9,17,25,33). A new drafter's taps, and capture's when
    it is given none; every tap list is then checked by the target's rule (dflash_train.target.check_layer_ids)."""
    if n < 1:
        raise UserError(f"number of tapped layers must be >= 1, got {n}")
    if num_layers < 4:
        raise UserError(f"a target with {num_layers} layers is too shallow for the default layer rule (needs >= 4)")
    from dflash_train.model.modeling_dflash import build_target_layer_ids  # here: the model module loads transformers

    ids = build_target_layer_ids(num_layers, n)
    if len(set(ids)) != n:
        raise UserError(f"cannot pick {n} distinct layers from a {num_layers}-layer target; pass --layers")
    return ids


# ----------------------------------------------------------------------------------------------------------------
# The mask token


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in (value if isinstance(value, (list, tuple)) else [value])}


def mask_token_problem(token_id: Any, vocab_size: int, forbidden: set[int]) -> str | None:
    """THE mask-token rule, or None when `token_id` keeps it: a row of the target's embedding table (`vocab_size`
    rows) and never a pad, EOS or stop id (`forbidden`): those appear in real text, so the drafter could not tell
    "predict here" from content."""
    if isinstance(token_id, bool) or not isinstance(token_id, int):
        return f"mask_token_id must be an integer token id, got {token_id!r}"
    if not 0 <= token_id < vocab_size:
        return f"mask_token_id {token_id} is not a row of the target's embedding table (0..{vocab_size - 1})"
    if token_id in forbidden:
        return (f"mask_token_id {token_id} is the target's pad or EOS token ({sorted(forbidden)}); pick a token "
                f"that never occurs in real text (a reserved row or an unused special token)")
    return None


def resolve_mask_token_id(tokenizer, vocab_size: int, requested: int | None = None,
                          forbidden: set[int] | None = None) -> int:
    """The id whose target embedding fills the non-anchor slots of a block (the rule: `mask_token_problem`).

    Default: the first reserved row past the tokenizer's vocabulary if the table has one (what the public Qwen3
    drafters use), else a special token that chat traffic never uses (for SmolLM2 `<repo_name>`). `requested`
    (from a recipe) is checked by the rule; `forbidden` adds ids to reject (e.g. the generation config's stop ids)
    to the tokenizer's pad and EOS.
    """
    bad = _token_ids(getattr(tokenizer, "pad_token_id", None)) | _token_ids(
        getattr(tokenizer, "eos_token_id", None)) | set(forbidden or ())
    if requested is not None:
        if problem := mask_token_problem(requested, vocab_size, bad):
            raise UserError(problem)
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
