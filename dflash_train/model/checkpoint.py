"""Drafter folders: create a drafter, save it in the public DFlash format, load it, read one for push, and start
one from its target's layers or from another drafter's weights (published.py finds and checks that drafter).

A saved folder holds config.json (configuration.DFlashConfig.to_config_json), model.safetensors (Qwen3 tensor
names, configuration.expected_tensor_names) and dflash.py, which is modeling_dflash.py byte for byte: the remote
code of `AutoModel.from_pretrained(DIR, trust_remote_code=True)`. The trainer adds training_args.json and
provenance.json next to them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

import torch

from dflash_train.errors import UserError
from dflash_train.model.configuration import LAYER_TENSORS, DFlashConfig, HfConfig, expected_tensor_shapes
from dflash_train.provenance import (INCOMPLETE_MARKER, PROVENANCE_FILE, Provenance, StageConfig, file_sha256,
                                     files_sha256, read_json, write_json_atomic)
from dflash_train.target import TargetRecord, TargetTensors

if TYPE_CHECKING:  # the module loads transformers; reading a folder for push must not
    from dflash_train.model.modeling_dflash import DFlashDraftModel
    from dflash_train.prompts import IngestReport, PromptSet
    from dflash_train.store.format import Generation

REMOTE_MODULE = Path(__file__).resolve().parent / "modeling_dflash.py"  # shipped as dflash.py (config.json's auto_map)


def create_drafter(config: DFlashConfig) -> DFlashDraftModel:
    """A freshly initialised drafter (weights from torch's global RNG: seed it first)."""
    from dflash_train.model.modeling_dflash import DFlashDraftModel

    return DFlashDraftModel(config.qwen3_config())


def save_drafter(model: DFlashDraftModel, config: DFlashConfig, out_dir: str | Path) -> Path:
    """Write config.json, model.safetensors and dflash.py in the model's dtype. A context scale (training only) is
    folded into fc, fc(x / s) = (W / s) x: the public format has no place for s."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = model.fc.weight.dtype
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    if model.context_scale is not None:
        folded = model.fc.weight.detach().float().cpu() / model.context_scale.cpu()[None, :]
        tensors["fc.weight"] = folded.to(dtype).contiguous()
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out / "model.safetensors")
    shutil.copyfile(REMOTE_MODULE, out / "dflash.py")
    write_json_atomic(out / "config.json", config.to_config_json(dtype))
    return out


def draft_vocabulary(config: DFlashConfig, target_head: torch.Tensor,
                     ids: list[int]) -> tuple[DFlashConfig, dict[str, torch.Tensor]]:
    """A drafter's config and extra tensors (configuration.DRAFT_VOCAB_TENSORS) for drafting only the target ids
    `ids` (sorted, distinct, fewer than the vocabulary): the target head's own rows for them, unchanged, and d2t,
    each row's offset to its id (row + d2t = id, as vLLM maps them)."""
    if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= config.vocab_size \
            or len(ids) >= config.vocab_size:
        raise ValueError(f"a draft vocabulary is 1 to {config.vocab_size - 1} distinct sorted ids of the target's "
                         f"{config.vocab_size}, got {len(ids)}")
    index = torch.tensor(ids, dtype=torch.long)
    tensors = {"lm_head.weight": target_head[index].contiguous(), "d2t": index - torch.arange(len(ids))}
    return dataclasses.replace(config, draft_vocab_size=len(ids)), tensors


def read_config(folder: str | Path) -> DFlashConfig:
    return config_json(Path(folder))[1]


def config_json(folder: Path) -> tuple[HfConfig, DFlashConfig]:
    """A drafter folder's config.json as written and as read (DFlashConfig.from_config_json: its dimensions bounded),
    the file inside the folder (`folder_file`)."""
    path = folder_file(folder, "config.json", f"{folder / 'config.json'}")
    if not path.is_file():
        raise UserError(f"{path} is missing: {folder} is not a drafter folder (the trainer writes it)")
    raw = read_json(path, "a drafter's config")
    return raw, DFlashConfig.from_config_json(raw, str(path))


def load_drafter(path: str | Path, dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu") -> tuple[DFlashDraftModel, DFlashConfig]:
    """A drafter folder written by `save_drafter` (or any public DFlash checkpoint of this architecture), and its
    config, read by the one reader of drafter folders (`read_weights`). dtype None keeps the stored dtype."""
    folder = Path(path)
    raw, config = config_json(folder)
    files = weight_files(folder)
    check_weights_fit_config(folder, config, files)
    state = read_weights(files, config)
    model = create_drafter(config)
    model.load_state_dict(state, strict=True)  # names and shapes checked above
    stored = getattr(torch, str(raw.get("dtype") or raw.get("torch_dtype") or "float32"), torch.float32)
    stored = stored if isinstance(stored, torch.dtype) else torch.float32
    return model.to(device=device, dtype=dtype or stored), config


# ----------------------------------------------------------------------------------------------------------------
# Reading a folder for push (no model built)


class StoreSummary(TypedDict):
    """A capture store a drafter was trained on, as training_args.json records it (its manifest's counts and
    settings)."""
    path: str
    num_samples: int
    num_tokens: int
    generation: Generation | None
    storage_dtype: str
    kind: str  # states | tokens
    ingest_report: IngestReport | None
    prompts: PromptSet | None
    replay: NotRequired[bool]  # an earlier round's store (recipe data.replay_stores); absent in older runs


class DataSummary(TypedDict):
    """training_args.json's `data` (stages/train/data.StoreSet.summary): every store, and their totals; with replay
    stores, how many of their samples trained out of how many they hold (recipe data.replay_samples)."""
    stores: list[StoreSummary]
    num_samples: int
    num_tokens: int
    replay_samples_trained: NotRequired[int]
    replay_samples_total: NotRequired[int]


class DraftVocabularyRecord(TypedDict):
    """What a chosen draft vocabulary covers (stages/train/draft_vocab.choose_draft_vocabulary), as the run records
    it."""
    size: int
    asked: int  # recipe drafter.draft_vocab_size
    answer_ids: int  # distinct ids in the training answers
    answer_tokens_covered: float | None  # the share of the training answers' tokens inside it
    chosen_from: str


class DraftVocabulary(DraftVocabularyRecord):
    ids: list[int]  # the target ids it drafts, ascending


class RunSummary(TypedDict, total=False):
    """training_args.json's `run` (stages/train/trainer): how the run went, and final_<key> for each figure of its
    last validation (stages/train/validation.HeldOutMetrics)."""
    steps: int
    final_train_loss: float | None
    train_time_s: float
    bad_steps: int
    wall_time_s: float
    world_size: int
    device: str
    resumed_from: str | None
    last_checkpoint_step: int
    precision: dict[str, str]  # device.Precision.as_dict
    hidden_states: str  # stored | online
    computed_by: str  # online: the target
    compute_dtype: str
    draft_vocab: DraftVocabularyRecord


class TrainingArgs(TypedDict, total=False):
    """training_args.json, beside the drafter the trainer exports (older drafters hold the recipe alone)."""
    recipe: StageConfig  # the resolved recipe, by section
    data: DataSummary
    run: RunSummary


class DrafterIdentity(TypedDict):
    """What decides a drafter's outputs (`drafter_identity`)."""
    sha256: str  # over both of these
    weights_sha256: str
    config: HfConfig  # its config.json but for this project's records


@dataclass
class DrafterFolder:
    dir: Path
    config_json: HfConfig  # config.json as written (the card quotes it)
    config: DFlashConfig
    num_parameters: int
    dtype: str  # of the stored weights, e.g. "bf16"
    training_args: TrainingArgs | None
    provenance: Provenance | None  # what made it (its own provenance.json, else the run folder's)

    @property
    def target(self) -> TargetRecord | None:
        """The identity of the target it was trained for (config.json's dflash_train.target)."""
        return self.config.target


# ----------------------------------------------------------------------------------------------------------------
# Reading a drafter folder that came from outside (warm start, eval, push, published layouts): every rule once.
# Its config's dimensions are bounded (configuration.MAX_DIMENSIONS), every file it names stays inside it
# (`folder_file`), its weights' headers are held against the config before a tensor is read
# (`check_weights_fit_config`), and every tensor read is finite (`read_weights`).

WEIGHTS_INDEX = "model.safetensors.index.json"


def folder_file(folder: Path, name: str, what: str) -> Path:
    """`folder / name`, or one line naming `what` when it would open a file outside the folder: an absolute name,
    one with '..', or a symbolic link that resolves elsewhere (a Hugging Face Hub snapshot's links may point into
    its repo's blob store, where the Hub keeps the files it names)."""
    path = folder / name
    real = path.resolve()
    inside = folder.resolve()
    roots = [inside] + ([inside.parent.parent / "blobs"] if inside.parent.name == "snapshots" else [])
    if Path(name).is_absolute() or ".." in Path(name).parts or not any(real.is_relative_to(r) for r in roots):
        raise UserError(f"{what} names a file outside the drafter folder {folder} ({real}): a drafter's files must "
                        f"be inside its folder; refused")
    return path


def weight_files(folder: Path) -> list[Path]:
    """The drafter's safetensors files, each inside its folder (`folder_file`): the shards its
    model.safetensors.index.json names, else model.safetensors."""
    index = folder / WEIGHTS_INDEX
    if index.exists():
        folder_file(folder, WEIGHTS_INDEX, str(index))
        weight_map = read_json(index, "sharded weights index").get("weight_map")
        if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
            raise UserError(f"{index}: weight_map is not an object naming each tensor's file")
        files: dict[str, Path] = {}
        for tensor, name in weight_map.items():
            if name not in files:
                files[name] = folder_file(folder, name, f"{index}: weight_map entry {tensor!r} ({name!r})")
        paths = [files[name] for name in sorted(files)]
    else:
        paths = [folder_file(folder, "model.safetensors", str(folder / "model.safetensors"))]
    for f in paths:
        if not f.is_file():
            pickled = sorted(p.name for p in folder.glob("*.bin"))
            raise UserError(f"{f} is missing: the drafter folder has no weights" + (
                f" (found {', '.join(pickled)}: convert it to safetensors; pickled weights are never loaded)"
                if pickled else ""))
    return paths


def damaged_weights(path: Path, why: str) -> UserError:
    """The one line for a drafter weights file that cannot be read."""
    return UserError(f"{path} is not a readable safetensors file ({why}): the drafter folder is damaged; copy or "
                     f"train it again")


class TensorEntry(TypedDict):
    """One tensor in a safetensors file's header."""
    dtype: str  # "BF16", "F32", ...
    shape: list[int]
    data_offsets: list[int]  # [begin, end) in the data after the header


def safetensors_header(path: Path) -> dict[str, TensorEntry]:
    """The tensor entries of a safetensors file's header ({name: {dtype, shape, data_offsets}}), without reading
    the weights; a UserError naming the file when the header is damaged."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise damaged_weights(path, f"{size} bytes, shorter than a header")
        (length,) = struct.unpack("<Q", raw)
        if length > size - 8:
            raise damaged_weights(path, f"its header claims {length} bytes, the file has {size}")
        try:
            header = json.loads(f.read(length))
        except (ValueError, UnicodeDecodeError) as err:
            raise damaged_weights(path, f"the header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise damaged_weights(path, "the header is not a JSON object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    for name, info in tensors.items():
        if not (isinstance(info, dict) and isinstance(info.get("shape"), list) and isinstance(info.get("dtype"), str)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in info["shape"])):
            raise damaged_weights(path, f"tensor {name!r} has no shape of sizes and dtype")
    return tensors


def safetensors_summary(path: Path) -> tuple[int, str]:
    """Parameter count and dtype(s) from a safetensors header, without loading the weights."""
    header = safetensors_header(path)
    count, dtypes = 0, set()
    for info in header.values():
        n = 1
        for dim in info["shape"]:
            n *= dim
        count += n
        dtypes.add(info["dtype"].lower())
    return count, "/".join(sorted(dtypes))


def check_weights_fit_config(folder: Path, config: DFlashConfig, files: list[Path],
                             set_aside: tuple[str, ...] = ()) -> dict[str, tuple[int, ...]]:
    """The weights' tensor names and shapes (from their headers, nothing read) must be the ones config.json implies
    (configuration.expected_tensor_shapes), its layer count first: an edited config.json would otherwise ship an
    unloadable drafter, or have a reader allocate for layers that are not there. Tensors named in `set_aside` (the
    target's, which some layouts store beside the drafter's) are not compared. Returns every {name: shape} found."""
    found: dict[str, tuple[int, ...]] = {}
    found_in: dict[str, str] = {}
    for f in files:
        found.update({name: tuple(info["shape"]) for name, info in safetensors_header(f).items()})
        found_in.update({name: f.name for name in safetensors_header(f)})
    layers = {int(m.group(1)) for name in found if (m := re.match(r"layers\.(\d+)\.", name))}
    if len(layers) != config.num_hidden_layers:  # before the table of expected names, which grows with it
        problems = [f"num_hidden_layers is {config.num_hidden_layers}, the weights hold {len(layers)} layer(s)"]
    else:
        mine = {name: shape for name, shape in found.items() if name not in set_aside}
        expected = expected_tensor_shapes(config)
        missing, unexpected = sorted(set(expected) - set(mine)), sorted(set(mine) - set(expected))
        problems = ([f"missing {', '.join(missing[:3])}"] if missing else []) + \
                   ([f"tensors this project's drafter does not have: {', '.join(unexpected[:3])}"]
                    if unexpected else []) + \
                   [f"{name} {list(mine[name])} in {found_in[name]} (config.json implies {list(shape)})"
                    for name, shape in expected.items() if name in mine and mine[name] != shape][:3]
    if problems:
        raise UserError(f"{folder}: the weights do not fit {folder / 'config.json'}, so the drafter would not load: "
                        f"{'; '.join(problems)}")
    return found


def read_weights(files: list[Path], config: DFlashConfig, keep: bool = True) -> dict[str, torch.Tensor]:
    """The tensors `config` implies (expected_tensor_shapes) of the safetensors `files` (checked by
    check_weights_fit_config first), as stored, each one finite, and a draft vocabulary's `d2t` a map of distinct
    target ids (`check_draft_map`): a damaged tensor is one line naming the file and the tensor (before it is trained
    from, evaluated or pushed). keep False: only the checks, one tensor in memory at a time."""
    from safetensors import SafetensorError, safe_open

    wanted, state = set(expected_tensor_shapes(config)), {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as reader:
                for name in sorted(wanted.intersection(reader.keys())):
                    tensor = reader.get_tensor(name)
                    check_finite(tensor, f, name)
                    if name == "d2t":
                        check_draft_map(tensor, f, config.vocab_size)
                    if keep:
                        state[name] = tensor
        except (SafetensorError, OSError) as err:
            raise damaged_weights(f, f"{type(err).__name__}: {err}") from None
    return state


def check_finite(tensor: torch.Tensor, source: Path, name: str) -> None:
    """A drafter tensor read from `source` must hold finite numbers only."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        nan, inf = int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())
        raise UserError(f"{source}: tensor {name} holds {nan} NaN and {inf} inf value(s): the drafter's weights are "
                        f"damaged (not a training setting); restore or retrain the drafter")


def check_draft_map(d2t: torch.Tensor, source: Path, vocab_size: int) -> None:
    """A draft vocabulary's d2t (read from `source`; its length, draft_vocab_size, is held against config.json by
    check_weights_fit_config) must map each row to its own target id, row + d2t, inside the target's vocabulary:
    integer offsets, no id outside 0..vocab_size - 1, no id twice (two rows would score one id)."""
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool:
        raise UserError(f"{source}: tensor d2t is {str(d2t.dtype).removeprefix('torch.')}, not integer offsets from "
                        f"the draft rows to target ids: the draft vocabulary is damaged; restore or retrain the "
                        f"drafter")
    ids = torch.arange(d2t.numel()) + d2t.reshape(-1).long()
    outside = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if len(outside):
        row = int(outside[0])
        raise UserError(f"{source}: tensor d2t maps draft row {row} to token id {int(ids[row])}, outside the "
                        f"target's vocabulary (0..{vocab_size - 1}): the draft vocabulary is damaged; restore or "
                        f"retrain the drafter")
    unique, counts = ids.unique(return_counts=True)
    if bool((counts > 1).any()):
        token = int(unique[counts > 1][0])
        rows = (ids == token).nonzero().reshape(-1).tolist()
        raise UserError(f"{source}: tensor d2t maps draft rows {rows[0]} and {rows[1]} to the same token id {token}: "
                        f"the draft vocabulary is damaged; restore or retrain the drafter")


def drafter_identity(folder: Path) -> DrafterIdentity:
    """What decides a drafter's outputs, as eval records it and push checks it: the sha256 of its weights (of
    model.safetensors; of each shard's name and sha256 for a sharded drafter), its config.json but for our own
    `dflash_train` records (every key an engine may read: vLLM and SGLang read keys this project's model does not,
    such as layer_types or dflash_config.mask_token, so no shorter list would stay true; the records only say which
    target it was made for and where it started, and push rewrites local paths in them), and one sha256 over both."""
    files = weight_files(folder)
    weights = file_sha256(files[0]) if len(files) == 1 else files_sha256(files)
    config = {k: v for k, v in config_json(folder)[0].items() if k != "dflash_train"}
    both = json.dumps({"weights_sha256": weights, "config": config}, sort_keys=True).encode()
    return {"sha256": hashlib.sha256(both).hexdigest(), "weights_sha256": weights, "config": config}


def check_finished(folder: str | Path) -> Path:
    """A drafter folder that exists and that its training run finished writing (no INCOMPLETE marker: a run killed
    while exporting leaves the old files beside it), or a UserError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"drafter folder {folder} does not exist (train one with `make train`)")
    if (folder / INCOMPLETE_MARKER).exists():
        raise UserError(f"drafter folder {folder} is marked incomplete: its training run did not finish "
                        f"writing it (rerun the training command to finish it)")
    return folder


def read_drafter_folder(folder: str | Path) -> DrafterFolder:
    """A finished drafter folder's config, weight summary and records, checked the way a push needs them: every
    file in it stays inside it (push uploads them all), and its weights' names and shapes must be the ones
    config.json implies (check_weights_fit_config)."""
    folder = check_finished(folder)
    for path in sorted(folder.iterdir()):
        folder_file(folder, path.name, str(path))
    raw, config = config_json(folder)
    auto_map = raw.get("auto_map") if isinstance(raw.get("auto_map"), dict) else {}
    for module in {str(v).split(".")[0] for v in auto_map.values()}:
        if not folder_file(folder, f"{module}.py", f"{folder / 'config.json'}'s auto_map entry {module!r}").exists():
            raise UserError(f"{folder / (module + '.py')} is missing: config.json's auto_map needs it "
                            f"for trust_remote_code loading")
    files = weight_files(folder)
    summaries = [safetensors_summary(f) for f in files]
    check_weights_fit_config(folder, config, files)
    read_weights(files, config, keep=False)
    training_args = None
    if (folder / "training_args.json").exists():  # (every file in the folder was held inside it above)
        training_args = read_json(folder / "training_args.json", "the trainer's resolved recipe")
    made_by = None  # the run folder's record when the drafter has none of its own
    for candidate in (folder / PROVENANCE_FILE, folder.parent / PROVENANCE_FILE):
        if candidate.exists():
            made_by = read_json(candidate, "what made the drafter")
            break
    return DrafterFolder(dir=folder, config_json=raw, config=config,
                         num_parameters=sum(n for n, _ in summaries),
                         dtype="/".join(sorted({d for _, d in summaries})), training_args=training_args,
                         provenance=made_by)


# ----------------------------------------------------------------------------------------------------------------
# Starting points other than random weights


def load_decoder_layers(name_or_path: str, layer_ids: list[int],
                        dtype: torch.dtype = torch.float32) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The weights of the target's decoder layers `layer_ids` (keys relative to the layer, e.g.
    self_attn.q_proj.weight; q_norm/k_norm only where the target has them) and its final norm, read straight from
    its safetensors files."""
    tensors = TargetTensors(name_or_path)
    layers = []
    for i in layer_ids:
        found = {name: tensors.read(f".layers.{i}.{name}", dtype) for name in LAYER_TENSORS}
        layer = {name: t for name, t in found.items() if t is not None}
        if "self_attn.q_proj.weight" not in layer:
            raise UserError(f"target {name_or_path}: no decoder layer {i} in the safetensors files of {tensors.path}")
        layers.append(layer)
    norm = tensors.read(".norm.weight", dtype)
    if norm is None:
        raise UserError(f"target {name_or_path}: no final norm (norm.weight) in {tensors.path}")
    return layers, norm


def init_from_target(model: DFlashDraftModel, layers: list[dict[str, torch.Tensor]],
                     final_norm: torch.Tensor) -> list[str]:
    """Start from the target instead of random weights: drafter layer i takes the weights of `layers[i]` (the
    target's top decoder layers, keys as in the target's layer: self_attn.q_proj.weight, ...), `norm` the
    target's final norm, `hidden_norm` the first copied layer's input norm, and fc passes the deepest tapped
    layer through unchanged (fused context = that layer's output, which is the first copied layer's input).
    q_norm/k_norm start at 1 where the target has none. Returns the names of the tensors set."""
    if len(layers) != len(model.layers):
        raise ValueError(f"{len(layers)} target layers for a {len(model.layers)}-layer drafter")
    set_names = []
    with torch.no_grad():
        for i, (layer, weights) in enumerate(zip(model.layers, layers)):
            for name, param in layer.named_parameters():
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
        model.norm.weight.copy_(final_norm)
        model.hidden_norm.weight.copy_(layers[0]["input_layernorm.weight"])
        H, ids = model.config.hidden_size, model.target_layer_ids
        deepest = max(range(len(ids)), key=lambda j: ids[j])
        scale = torch.ones(H) if model.context_scale is None else model.context_scale[deepest * H:(deepest + 1) * H]
        model.fc.weight.zero_()
        model.fc.weight[:, deepest * H:(deepest + 1) * H] = torch.diag(scale.to(model.fc.weight.device))
    return set_names + ["norm.weight", "hidden_norm.weight", "fc.weight"]


def load_start(model: DFlashDraftModel, state: dict[str, torch.Tensor]) -> None:
    """Load a starting drafter's weights (fine-tuning). Exported weights act on the raw tapped states: under a
    context scale, fc is unfolded (fc(x / s) with W s = W x)."""
    state = dict(state)
    if model.context_scale is not None:
        state["fc.weight"] = state["fc.weight"] * model.context_scale.cpu()[None, :]
    model.load_state_dict(state, strict=True)
