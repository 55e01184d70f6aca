"""Published drafters as starting points: a DFlash drafter in any public layout, from a folder or a Hub repo.

    source = fetch_drafter("z-lab/Qwen3-8B-DFlash-b16", revision=None)   # or a local folder
    drafter = read_drafter(source)        # -> DFlashConfig + weights (the drafter's own tensors, float32)

The field starts from a published general drafter and adapts it to a service's own traffic (`drafter.init_from`).
Four layouts of the same model are public; all four hold the same tensors under the same names (a Qwen3-style
decoder layer per drafter layer, `fc`, `hidden_norm`, `norm`) and differ in config.json:

  dflash-train   architectures [DFlashDraftModel], dflash_config {mask_token_id, target_layer_ids}, block_size at
                 the top level, and our `dflash_train` section (the target's identity)
  z-lab          the reference drafters on the Hub: the same keys without `dflash_train`; `block_size` at the top
                 level (Qwen3, Llama drafters) or inside `dflash_config` (Qwen3.5 drafters); an `auto_map`
  SpecForge      the z-lab layout, with `dflash_config.projector_type` ("dflash"; its Domino and DSpark variants
                 carry modules of their own and are refused) and at times the embedding beside the weights
  speculators    `speculators_model_type: dflash`, the decoder settings under `transformer_layer_config`, and
                 `aux_hidden_state_layer_ids`, which count the embedding output as layer 0: z-lab's ids + 1

Tensors that are the target's (embedding, LM head, the verifier's norm and head in speculators' files) are not the
drafter's: they are set aside, and the target's own are used. A drafter whose math this project's model does not
have (sliding-window layers, an output multiplier or soft cap, a reduced draft vocabulary, DFlash2's convolutions)
is refused with one line naming what it has. `DrafterSource` records where the weights came from (repo, revision,
layout, sha256 of each weight file) for provenance and the model card. `drafter_to_start_from` checks one against
the run that fine-tunes it (the target, the store's tapped layers, the recipe's drafter keys).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import torch

from dflash_train.errors import UserError, in_brief
from dflash_train.model.checkpoint import check_weights_fit_config, folder_file, read_weights, weight_files
from dflash_train.model.configuration import ARCHITECTURE, DFlashConfig, HfConfig
from dflash_train.target import Features, check_fits

LAYOUTS = ("dflash-train", "z-lab", "SpecForge", "speculators")
# The target's tensors that some layouts store beside the drafter's: the embedding and LM head the drafter borrows,
# speculators' copies of the verifier's final norm and head, and its draft<->target vocabulary maps.
TARGET_TENSORS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight", "t2d",
                  "d2t")
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.md"]


class SourceRecord(TypedDict):
    """A DrafterSource as provenance, config.json (dflash_train.fine_tuned_from) and the card keep it."""
    name: str
    repo: str | None
    revision: str | None
    layout: str | None
    weights_sha256: dict[str, str]


class RecipeDrafterKeys(TypedDict):
    """The recipe's explicit drafter keys a starting drafter must have (None: the starting drafter's own)."""
    num_layers: int | None
    mask_token_id: int | None
    target_layer_ids: list[int] | None


@dataclass
class DrafterSource:
    """Where a starting drafter came from; `record()` is what provenance, config.json and the card keep."""
    name: str  # the Hub repo id, or the folder's name (never a local absolute path)
    folder: Path  # where its files are on this machine
    repo: str | None = None  # the Hub repo id, when it came from the Hub
    revision: str | None = None  # the commit it was downloaded at
    layout: str | None = None  # one of LAYOUTS, once read
    weights_sha256: dict[str, str] = field(default_factory=dict)  # file name -> sha256

    def record(self) -> SourceRecord:
        return {"name": self.name, "repo": self.repo, "revision": self.revision, "layout": self.layout,
                "weights_sha256": dict(self.weights_sha256)}


@dataclass
class PublishedDrafter:
    config: DFlashConfig
    state: dict[str, torch.Tensor]  # the drafter's own tensors, float32, named as the model module names them
    source: DrafterSource
    set_aside: list[str]  # the target's tensors found in the files, not used


def looks_like_repo_id(text: str) -> bool:
    """`org/name` with no path syntax: a Hub repo id rather than a folder."""
    return (text.count("/") == 1 and not text.startswith((".", "/", "~")) and not text.endswith("/")
            and all(part.strip() for part in text.split("/")))


def fetch_drafter(source: str, revision: str | None = None, what: str = "drafter.init_from") -> DrafterSource:
    """A drafter folder on this machine: `source` itself when it is a folder, else the Hub repo `source` at
    `revision` (default: main), downloaded once into the Hugging Face cache (HF_HUB_OFFLINE=1 reads the cache
    only, HF_ENDPOINT picks the Hub). One UserError naming the source when neither works."""
    local = Path(source).expanduser()
    if local.is_dir():
        if revision is not None:
            raise UserError(f"{what} {source} is a folder on this machine: a revision ({revision}) names a commit of "
                            f"a Hub repo; remove it")
        return DrafterSource(name=local.resolve().name, folder=local)
    if not looks_like_repo_id(source):
        raise UserError(f"{what} {source!r} is neither a drafter folder on this machine nor a Hub repo id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(source, revision=revision, allow_patterns=WEIGHT_PATTERNS))
    except Exception as err:  # any Hub failure (missing repo, revision, network, offline cache miss) is one line
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        offline = os.environ.get("HF_HUB_OFFLINE", "unset")
        raise UserError(f"{what} {source!r}{f' at revision {revision}' if revision else ''} is not a folder on this "
                        f"machine and could not be fetched from the Hub at {endpoint} ({in_brief(err)}); "
                        f"HF_HUB_OFFLINE={offline}") from None
    return DrafterSource(name=source, folder=folder, repo=source, revision=folder.name)


def read_drafter(source: DrafterSource) -> PublishedDrafter:
    """The config and weights of the drafter in `source.folder`, whatever its layout (module docstring)."""
    from dflash_train.provenance import file_sha256, read_json

    folder = source.folder
    config_file = folder_file(folder, "config.json", f"{source.name}: config.json")
    if not config_file.is_file():
        raise UserError(f"{source.name}: no config.json in {folder}: not a drafter")
    raw = read_json(config_file, "a drafter's config")
    layout, zlab = _as_zlab(raw, source.name)
    config = DFlashConfig.from_config_json(zlab, str(config_file))
    if layout == "speculators":
        config.num_target_layers = None  # not recorded: the target it meets decides
    config.extra = {}  # our own records of another run (its fine-tuning source, ...) do not carry over
    config.draft_vocab_size = None  # nor its draft vocabulary: training scores the target's whole head (the rows
    #                                 are the target's, set aside below) and the export chooses its own
    files = weight_files(folder)
    found = check_weights_fit_config(folder, config, files, set_aside=TARGET_TENSORS)
    state = {k: v.float() for k, v in read_weights(files, config).items()}
    source.layout = layout
    source.weights_sha256 = {f.name: file_sha256(f) for f in files}
    return PublishedDrafter(config=config, state=state, source=source,
                            set_aside=sorted(k for k in found if k in TARGET_TENSORS))


def _as_zlab(raw: HfConfig, name: str) -> tuple[str, HfConfig]:
    """(layout, config.json in the z-lab layout) of any public layout, refusing drafters whose math differs."""
    if "speculators_model_type" in raw:
        kind = raw["speculators_model_type"]
        if kind != "dflash":
            raise UserError(f"{name}: a speculators {kind!r} drafter: only plain DFlash drafters "
                            f"(speculators_model_type 'dflash') can be fine-tuned here")
        layer = dict(raw.get("transformer_layer_config") or {})
        aux = raw.get("aux_hidden_state_layer_ids")
        if not layer or not isinstance(aux, list):
            raise UserError(f"{name}: a speculators config needs transformer_layer_config and "
                            f"aux_hidden_state_layer_ids")
        vocab, draft_vocab = layer.get("vocab_size"), raw.get("draft_vocab_size")
        if draft_vocab is not None and vocab is not None and draft_vocab != vocab:
            raise UserError(f"{name}: a reduced draft vocabulary ({draft_vocab} of the target's {vocab} tokens): this "
                            f"project's drafters draft over the target's whole vocabulary with its own LM head")
        if raw.get("sample_from_anchor"):
            raise UserError(f"{name}: sample_from_anchor is set: this project's drafters predict from the mask slots "
                            f"only (slot 0, the anchor, has no loss)")
        # speculators counts the embedding output as layer 0: its aux layer i is decoder layer i - 1's output
        zlab = {**layer, "architectures": [ARCHITECTURE],
                **({"block_size": raw["block_size"]} if raw.get("block_size") is not None else {}),
                "dflash_config": {"mask_token_id": raw.get("mask_token_id"),
                                  "target_layer_ids": [int(i) - 1 for i in aux]}}
        _refuse_other_math(zlab, name)
        return "speculators", zlab
    architectures = raw.get("architectures") or []
    if ARCHITECTURE not in architectures:
        raise UserError(f"{name}: architectures {architectures!r}: not a DFlash drafter ({ARCHITECTURE}); DFlash2, "
                        f"DSpark and other variants carry modules this project does not train")
    dflash = raw.get("dflash_config") or {}
    projector = dflash.get("projector_type")
    if projector not in (None, "dflash"):
        raise UserError(f"{name}: dflash_config.projector_type is {projector!r}: a SpecForge {projector} drafter has "
                        f"modules of its own; only plain DFlash drafters can be fine-tuned here")
    _refuse_other_math(raw, name)
    if raw.get("dflash_train"):
        return "dflash-train", raw
    return ("SpecForge" if projector else "z-lab"), raw


def _refuse_other_math(cfg: HfConfig, name: str) -> None:
    """Settings some DFlash variants use that this project's model does not compute: one line naming them."""
    dflash = cfg.get("dflash_config") or {}
    found = []
    layer_types = cfg.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        found.append(f"layer_types {sorted(set(layer_types))}")
    for key, plain in (("output_multiplier", 1), ("final_logit_softcapping", 0)):
        value = dflash.get(key, cfg.get(key))
        if value is not None and value != plain:
            found.append(f"{key} {value}")
    if cfg.get("attention_bias"):
        found.append("attention_bias true")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        found.append(f"hidden_act {cfg.get('hidden_act')!r}")
    if found:
        raise UserError(f"{name}: its config has {', '.join(found)}, which this project's drafter does not compute "
                        f"(full-attention Qwen3 layers with SwiGLU, no bias, plain logits): it cannot be fine-tuned "
                        f"here")


def describe(source: SourceRecord) -> str:
    """One line for people: 'org/name (z-lab layout) at revision abc1234'."""
    text = source.get("repo") or source.get("name") or "a drafter"
    if source.get("layout"):
        text += f" ({source['layout']} layout)"
    if source.get("revision"):
        text += f" at revision {str(source['revision'])[:12]}"
    return text


def drafter_to_start_from(init_from: str, revision: str | None, wanted: RecipeDrafterKeys, block_size: int,
                          reads: Features, target_name: str, target_config, tokenizer, stop_ids: list[int]):
    """The published drafter a run fine-tunes (`drafter.init_from`, a folder or Hub repo id in any public layout:
    this module), checked against what the run trains for, every mismatch named in one line: the target
    (its identity where the drafter records one, hidden size, layer count, vocabulary, a usable mask token), the
    store's tapped layers (`reads`), and the recipe's explicit drafter keys (`wanted`: num_layers, mask_token_id,
    target_layer_ids; None = the starting drafter's). The block size is the recipe's: the weights do not depend on
    it. Returns the PublishedDrafter with its config made this run's."""
    start = read_drafter(fetch_drafter(init_from, revision))
    config = start.config
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    L = text.num_hidden_layers
    if config.num_target_layers is None:
        config.num_target_layers = L
    problems = [f"recipe drafter.{key} is {value}, the drafter's is {getattr(config, attr)}"
                for key, attr, value in (("num_layers", "num_hidden_layers", wanted.get("num_layers")),
                                         ("mask_token_id", "mask_token_id", wanted.get("mask_token_id")),
                                         ("target_layer_ids", "target_layer_ids", wanted.get("target_layer_ids")))
                if value is not None and value != getattr(config, attr)]
    forbidden = {int(i) for i in [*stop_ids, tokenizer.pad_token_id, tokenizer.eos_token_id] if i is not None}
    problems += config.target_problems(L, text.vocab_size, forbidden)
    check_fits(f"drafter.init_from {describe(start.source.record())}", config.features(),
               f"target {target_name} as the store captured it", reads, problems)
    config.block_size = block_size
    config.target = reads.target.to_dict() if reads.target is not None else config.target
    if config.mask_token is None and config.mask_token_id < len(tokenizer):
        config.mask_token = tokenizer.convert_ids_to_tokens(config.mask_token_id)
    return start
