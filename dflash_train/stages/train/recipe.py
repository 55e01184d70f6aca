"""Training recipes: one YAML file per run, typed and validated when it is loaded.

A recipe is a tree of dataclasses. Every key in the file must name a field, and every value must have the
field's type (a float field takes finite numbers only: .inf and .nan are refused); anything else is a `UserError`
naming the dotted key and the file. `key=value` overrides on the command line (`objective.num_anchors=64`,
`train.max_steps=10`) are parsed as YAML scalars and validated the same way. Relative paths in a recipe are
relative to the directory the command runs from (the repo root).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from dflash_train.errors import UserError
from dflash_train.provenance import StageConfig


@dataclass
class DataSection:
    stores: list[str] = field(default_factory=list)  # capture store folders, concatenated
    eval_store: str | None = None  # a held-out store; if None, `eval_fraction` of the training store is held out
    eval_fraction: float = 0.0  # by a hash of the sample id, so the split never changes between runs
    eval_samples: int = 32  # held-out samples used at each eval (the first N of the held-out set)
    max_length: int = 3072  # longer samples are truncated to their first max_length tokens
    batching: Literal["padding", "packing"] = "padding"  # packing: whole samples back to back up to max_length
    max_samples: int | None = None  # train on the first N training samples only (data-size curves); None = all
    # earlier rounds' capture stores trained beside `stores` so the drafter keeps what it knew (a refresh round): they
    # must fit `stores` (target, taps, hidden size), are never held out (eval_fraction, eval_store and max_samples
    # concern `stores` alone), and a sample whose id is held out from `stores` does not train from them either
    replay_stores: list[str] = field(default_factory=list)
    # at most this many replay samples train, those whose id hashes lowest: the same ones in every run and resume,
    # whatever the order of replay_stores; None = all of them
    replay_samples: int | None = None
    # Where the drafter's input states come from. stored: the store's tapped states, as captured. online: the frozen
    # target (all of it, on every rank, in train.precision) computes them for each micro batch without gradients;
    # token-only stores (capture --storage none) need it, and a store's own states are then not read
    hidden_states: Literal["stored", "online"] = "stored"


@dataclass
class DrafterSection:
    target: str | None = None  # embedding + LM head source; None = the store manifest's target name
    num_layers: int | None = None  # None: 5 for a new drafter; under init_from the starting drafter's
    block_size: int = 16
    mask_token_id: int | None = None  # None = the drafter's rule (a reserved row or an unused special token)
    target_layer_ids: list[int] | None = None  # None = the store's; if set it must equal the store's
    # random: the public recipe. target: the target's top num_layers decoder layers, its final norm, and an fc that
    # passes the deepest tapped layer through (see dflash_train.model.checkpoint.init_from_target)
    init: Literal["random", "target"] = "random"
    # start from a trained drafter (fine-tuning; wins over `init`): a folder or a Hub repo id (org/name), in any
    # public DFlash layout (dflash_train/model/published.py); its shape and taps are the run's
    init_from: str | None = None
    init_revision: str | None = None  # the Hub revision (branch, tag or commit) of init_from; None = main
    context_norm: bool = False  # divide each tapped channel by its RMS on the store before fc (folded at export)
    # the drafter drafts only this many of the target's ids, with the target head's rows for them, in training and
    # exported (vLLM reads them; SGLang drafts with the whole head): the training answers' most used ids, then
    # their prompts' (stages/train/draft_vocab.py); a label outside them gets no loss. None: the whole vocabulary
    draft_vocab_size: int | None = None


@dataclass
class ObjectiveSection:
    num_anchors: int = 512  # blocks per sequence, sampled anew every step
    # anchors whose last two tokens already occur earlier in their sample (objective.repeats_context: where the
    # continuation can be copied from the context) are drawn this many times as often as the others; 1 = uniform
    copy_anchor_weight: float = 1.0
    decay_gamma: float | None = None  # slot weight exp(-(k-1)/gamma); None = 7 for block 16 (scaled with B)
    attention: Literal["auto", "sdpa", "flex"] = "auto"  # auto: FlexAttention on CUDA, dense mask + SDPA else
    head_chunk_tokens: int = 256  # block slots per LM-head + CE chunk: full logits never exist at once
    # the first fraction of the run (of max steps, or of the time budget) trains blocks that see only the last
    # context_warmup_window context positions before their anchor (0: none) and their own slots: the drafter learns
    # to read the anchor and the newest states before hundreds of older positions can drown them out
    context_warmup_ratio: float = 0.0
    context_warmup_window: int = 0
    soft_label_weight: float = 0.0  # loss = (1-a) CE + a KL to the target's top-k (needs capture --store-topk K)


@dataclass
class OptimizerSection:
    lr: float = 6e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_ratio: float = 0.04
    # after linear warmup: cosine to lr * min_lr_ratio, constant, or wsd (warmup-stable-decay: constant, then a
    # linear decay to lr * min_lr_ratio over the last decay_ratio of the run)
    schedule: Literal["cosine", "constant", "wsd"] = "cosine"
    min_lr_ratio: float = 0.0
    decay_ratio: float = 0.2
    grad_clip: float = 1.0


@dataclass
class TrainSection:
    epochs: float = 6.0
    max_steps: int | None = None  # optimizer steps; overrides epochs when set (0: export the starting drafter as is)
    # stop after this many seconds of training (evals and checkpoints not counted); the learning-rate schedule then
    # runs on the fraction of the budget used, so runs of different speeds get whole schedules. Not reproducible
    # step for step across machines (use max_steps for that).
    time_budget_s: float | None = None
    micro_batch_size: int = 1  # sequences (padding) or packed rows (packing) per process per micro step
    grad_accum_steps: int = 1
    # auto: bf16 where the device runs it natively (CUDA, a CPU with AVX512_BF16/AMX), else fp32 (an AVX2-only CPU
    # emulates bf16 3-10x slower than fp32); see dflash_train.device. The drafter is saved in the target's dtype.
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    gradient_checkpointing: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    deepspeed: str | None = "recipes/deepspeed/zero2.json"  # None = plain DDP
    max_bad_steps: int = 5  # this many non-finite losses in a row abort the run
    cpu_threads: int | None = None  # CPU only: threads per process; None = the machine's cores / local processes


@dataclass
class CheckpointSection:
    every: int = 500  # optimizer steps; a checkpoint is also written at the end
    keep_last: int = 2
    resume: str = "auto"  # auto (newest checkpoint in the run, if any) | never | a checkpoint folder


@dataclass
class EvalSection:
    every: int = 250  # optimizer steps; 0 = only at the end
    at_end: bool = True


@dataclass
class LoggingSection:
    wandb_project: str = "dflash-train"
    wandb_mode: Literal["online", "offline", "disabled"] = "disabled"  # the WANDB_MODE environment variable wins
    wandb_run_name: str | None = None
    log_every: int = 1  # optimizer steps between metrics.jsonl rows
    progress_bar: bool = True


@dataclass
class PushSection:
    min_tau: float | None = None  # `dflash-train push` refuses an eval report below this acceptance length


@dataclass
class Recipe:
    name: str = "run"
    output_dir: str = "runs/run"
    seed: int = 0
    license: str | None = None  # Hub license id for the model card (apache-2.0, mit, other, ...)
    data: DataSection = field(default_factory=DataSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    eval: EvalSection = field(default_factory=EvalSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    push: PushSection = field(default_factory=PushSection)

    def to_dict(self) -> StageConfig:
        return dataclasses.asdict(self)

    @property
    def decay_gamma(self) -> float:
        if self.objective.decay_gamma is not None:
            return self.objective.decay_gamma
        return 7.0 * self.drafter.block_size / 16


# --- loading and validation ----------------------------------------------------------------------------


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise UserError(f"recipe {path} is not UTF-8 text (byte {err.start})") from None
    except yaml.YAMLError as err:
        raise UserError(f"recipe {path} is not valid YAML: {yaml_problem(err)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"recipe {path}: the top level must be a mapping of keys, got {type(raw).__name__}")
    for item in overrides:
        apply_override(raw, item, path)
    recipe = from_dict(Recipe, raw, source=str(path))
    check_recipe(recipe, str(path))
    return recipe


def yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's error in one line: its message spans several, with a drawing of the line and a caret."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).strip().splitlines()[0]
    return problem + (f" (line {mark.line + 1}, column {mark.column + 1})" if mark else "")


def apply_override(raw: dict[str, Any], item: str, source: str | Path) -> None:
    """Apply one `dotted.key=value` override to the raw mapping (value parsed as a YAML scalar or list)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise UserError(f"override {item!r} for recipe {source} is not of the form key=value")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as err:
        raise UserError(f"override {item!r} for recipe {source}: the value is not valid YAML: {yaml_problem(err)}"
                        ) from None
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise UserError(f"override {item!r} for recipe {source}: {'.'.join(parts[:i + 1])!r} is not a section")
        node = child
    node[parts[-1]] = value


def from_dict(cls: type, raw: Any, source: str, prefix: str = "") -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise UserError(f"recipe {source}: {where!r} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise UserError(f"recipe {source}: unknown key {prefix + str(key)!r} "
                            f"(known in {where}: {', '.join(sorted(names))})")
    kwargs = {}
    for key, value in raw.items():
        kwargs[key] = _convert(hints[key], value, source, prefix + key)
    return cls(**kwargs)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


class _NotFinite(UserError):
    """A float field given inf or NaN: said as such, even where the field also accepts null."""


def _convert(tp: Any, value: Any, source: str, key: str) -> Any:
    def bad() -> UserError:
        return UserError(f"recipe {source}: key {key!r} must be {_type_name(tp)}, got {value!r}")

    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, {} if value is None else value, source, key + ".")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad()
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, source, key)
            except _NotFinite:
                raise
            except UserError:
                continue
        raise bad()
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise bad()
    if origin is list:
        if not isinstance(value, list):
            raise bad()
        (item_type,) = typing.get_args(tp)
        return [_convert(item_type, v, source, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # PyYAML reads 6e-4 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise bad()
        if not math.isfinite(number):  # .inf / .nan: every float of a recipe is a finite number
            raise _NotFinite(f"recipe {source}: key {key!r} must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise TypeError(f"recipe field {key} has an unsupported type {tp}")


def check_recipe(recipe: Recipe, source: str) -> None:
    """Value checks that types alone cannot express."""

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:
            value = recipe
            for part in key.split("."):
                value = getattr(value, part)
            raise UserError(f"recipe {source}: key {key!r} {rule}, got {value!r}")

    need(len(recipe.data.stores) > 0, "data.stores", "must list at least one capture store folder")
    need(0.0 <= recipe.data.eval_fraction < 1.0, "data.eval_fraction", "must be in [0, 1)")
    need(recipe.data.eval_samples >= 1, "data.eval_samples", "must be >= 1")
    need(recipe.data.max_length >= 2, "data.max_length", "must be >= 2")
    need(recipe.data.max_samples is None or recipe.data.max_samples >= 1, "data.max_samples", "must be >= 1")
    need(recipe.data.replay_samples is None or recipe.data.replay_samples >= 0, "data.replay_samples", "must be >= 0")
    read = {str(Path(f).expanduser().resolve()) for f in [*recipe.data.stores, recipe.data.eval_store] if f}
    replay = [str(Path(f).expanduser().resolve()) for f in recipe.data.replay_stores]
    need(len(set(replay)) == len(replay) and not read.intersection(replay), "data.replay_stores",
         "must list each store once and none of data.stores or data.eval_store (their held-out samples would train)")
    need(recipe.train.time_budget_s is None or recipe.train.time_budget_s > 0, "train.time_budget_s", "must be > 0")
    need(0.0 < recipe.optimizer.decay_ratio <= 1.0, "optimizer.decay_ratio", "must be in (0, 1]")
    need(recipe.drafter.num_layers is None or recipe.drafter.num_layers >= 1, "drafter.num_layers", "must be >= 1")
    need(recipe.drafter.block_size >= 2, "drafter.block_size", "must be >= 2")
    need(recipe.drafter.draft_vocab_size is None or recipe.drafter.draft_vocab_size >= 1, "drafter.draft_vocab_size",
         "must be >= 1")
    need(recipe.drafter.draft_vocab_size is None or recipe.objective.soft_label_weight == 0,
         "drafter.draft_vocab_size", "must be unset with objective.soft_label_weight > 0 (soft labels are the "
         "target's top-k over its whole vocabulary)")
    need(recipe.objective.num_anchors >= 1, "objective.num_anchors", "must be >= 1")
    need(recipe.objective.copy_anchor_weight > 0, "objective.copy_anchor_weight", "must be > 0")
    need(recipe.objective.decay_gamma is None or recipe.objective.decay_gamma > 0, "objective.decay_gamma",
         "must be > 0")
    need(recipe.objective.head_chunk_tokens >= 1, "objective.head_chunk_tokens", "must be >= 1")
    need(0.0 <= recipe.objective.context_warmup_ratio < 1.0, "objective.context_warmup_ratio", "must be in [0, 1)")
    need(recipe.objective.context_warmup_window >= 0, "objective.context_warmup_window", "must be >= 0")
    need(0.0 <= recipe.objective.soft_label_weight <= 1.0, "objective.soft_label_weight", "must be in [0, 1]")
    need(recipe.optimizer.lr > 0, "optimizer.lr", "must be > 0")
    need(recipe.optimizer.weight_decay >= 0, "optimizer.weight_decay", "must be >= 0")
    need(len(recipe.optimizer.betas) == 2 and all(0 <= b < 1 for b in recipe.optimizer.betas),
         "optimizer.betas", "must be two numbers in [0, 1)")
    need(0.0 <= recipe.optimizer.warmup_ratio < 1.0, "optimizer.warmup_ratio", "must be in [0, 1)")
    need(0.0 <= recipe.optimizer.min_lr_ratio <= 1.0, "optimizer.min_lr_ratio", "must be in [0, 1]")
    need(recipe.optimizer.grad_clip >= 0, "optimizer.grad_clip", "must be >= 0 (0 = no clipping)")
    need(recipe.train.epochs > 0, "train.epochs", "must be > 0")
    need(recipe.train.max_steps is None or recipe.train.max_steps >= 0, "train.max_steps", "must be >= 0")
    need(recipe.train.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    need(recipe.train.grad_accum_steps >= 1, "train.grad_accum_steps", "must be >= 1")
    need(recipe.train.max_bad_steps >= 1, "train.max_bad_steps", "must be >= 1")
    need(recipe.train.cpu_threads is None or recipe.train.cpu_threads >= 1, "train.cpu_threads", "must be >= 1")
    need(recipe.checkpoint.every >= 1, "checkpoint.every", "must be >= 1")
    need(recipe.checkpoint.keep_last >= 1, "checkpoint.keep_last", "must be >= 1")
    need(recipe.eval.every >= 0, "eval.every", "must be >= 0")
    need(recipe.logging.log_every >= 1, "logging.log_every", "must be >= 1")
    init_from = recipe.drafter.init_from
    if init_from is not None:
        from dflash_train.model.published import looks_like_repo_id

        folder = Path(init_from).expanduser()
        if folder.is_dir() and not (folder / "config.json").is_file():
            raise UserError(f"recipe {source}: key 'drafter.init_from' names the folder {init_from}, which is not a "
                            f"drafter folder (no config.json)")
        if not folder.is_dir() and not looks_like_repo_id(init_from):
            raise UserError(f"recipe {source}: key 'drafter.init_from' names {init_from}, which is neither a drafter "
                            f"folder nor a Hub repo id (org/name)")
    if recipe.drafter.init_revision is not None and init_from is None:
        raise UserError(f"recipe {source}: key 'drafter.init_revision' is set without drafter.init_from")
    if recipe.train.deepspeed is not None and not Path(recipe.train.deepspeed).is_file():
        raise UserError(f"recipe {source}: key 'train.deepspeed' names {recipe.train.deepspeed}, which does not "
                        f"exist (paths are relative to the directory you run from)")
