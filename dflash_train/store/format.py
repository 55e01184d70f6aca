"""The capture store's format, what its writer and its readers share: a few large safetensors shards plus a
manifest.json, read with memory-mapped random access.

Layout of a store folder:
  manifest.json                       what the store holds (target identity, layers, dtype, decoding, shards)
  shard-r000-00000.safetensors ...    per rank, numbered; each holds whole samples as concatenated token streams
  journal-r000.json                   per rank: the shards it has finished (the resume point of that rank)
  provenance.json                     what made the folder
  .dflash-train.lock                  held while a capture writes the folder (provenance.OutputClaim)

A shard holds
  input_ids      int32  [T]           every sample's tokens, one after another
  loss_mask      bool   [T]           True on the target's response tokens
  hidden_states  bf16 | float8_e4m3fn [T, n*H]   tapped layers concatenated, every position (not in a token-only
                                      store: storage_dtype "none", kind "tokens"; training computes them)
  scales         float32 [T]          (fp8 only) one scale per token: state = fp8 * scale
  topk_ids       int32  [T, K]        (capture --store-topk K) the target's K most likely tokens for position t,
  topk_logprobs  float16 [T, K]       and their log-probabilities under the full softmax (not renormalised), from
                                      the logits at t-1 (same-position convention: they predict token t itself);
                                      position 0 of a sample has no prediction: ids 0, log-probs -inf
  offsets        int64  [N+1]         sample i is tokens offsets[i]:offsets[i+1]
  weights        int64  [N]
and the sample ids (and the ids left out, with the reason: non-finite states, prompt too long, ...) as JSON in
the safetensors metadata.

Shards are written under a temporary name, fsynced, hashed and renamed; only then does the rank's journal list
them. A killed writer therefore leaves finished shards (kept on rerun) and at most one temporary file (deleted
on rerun, its samples redone): every sample ends up in the store exactly once.

A store knows the set it holds: its settings (fixed when it is started, checked on every rerun) include the target,
the tapped layers, the decoding settings and the prompt set (`prompts`: the ingest folder, its split and split
rule), so that eval prompts never join a store of training prompts. Training and eval re-hash the shards when they
open a store (`store.verify.check_hashes`); what was verified is remembered per shard (provenance.known_sha256:
size, mtime, inode), so a rerun hashes only shards that changed.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np
import torch

from dflash_train.errors import UserError

if TYPE_CHECKING:
    from dflash_train.prompts import IngestReport, PromptSet
    from dflash_train.provenance import StageConfig
    from dflash_train.target import TargetRecord, TemplateKwargs

FORMAT = "dflash-train-store"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# storage_dtype "none": a token-only store (token ids, loss mask, weights, optional top-k, no hidden states), about
# 1,000x smaller than one with bf16 states; the trainer computes the states with the target (data.hidden_states:
# online). It still records the target, the tapped layer ids and the hidden size: what the drafter will read.
NO_STATES = "none"
STORAGE_CHOICES = (*STORAGE_DTYPES, NO_STATES)
BYTES_PER_VALUE = {"bf16": 2, "fp8": 1, NO_STATES: 0}
BYTES_PER_TOKEN_ID = 4 + 1  # int32 token id + bool loss mask
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
# float16 log-probs: values lie in about [-40, 0], where float16 keeps 11 significant bits (an error of at most
# 0.0005 nats for log-probs above -1, the tokens that carry the soft label); bfloat16 would be 8x coarser for the
# same 2 bytes, float32 twice the bytes for no measurable gain. -inf (no prediction) is representable.
TOPK_LOGPROB_DTYPE = torch.float16
BYTES_PER_TOPK = 4 + 2  # int32 id + float16 log-prob
STAGE = "capture"  # the stage whose folders stores are (provenance)


class Generation(TypedDict, total=False):
    """How a store's answers were decoded (capture's options), as its settings record them; a store captured before
    a key was recorded lacks it."""
    responses: str  # generate | logged
    max_new_tokens: int  # per prompt: the logged request's max_tokens where smaller
    max_prompt_tokens: int
    temperature: float | None  # None: per logged request, greedy where the log has none
    top_p: float | None
    seed: int
    template_kwargs: TemplateKwargs
    add_generation_prompt: bool
    stop_token_ids: list[int]
    compute_dtype: str
    engine: str  # own | vllm
    constraints: str  # "ignore" (recorded only then)
    engine_version: str  # vLLM's, under engine vllm


class StoreSettings(TypedDict):
    """What a store is started with and every rerun must match (each journal's `settings`); a store written before
    `topk` or `prompts` was recorded lacks it."""
    target: TargetRecord
    target_layer_ids: list[int]
    hidden_size: int
    num_tapped: int
    storage_dtype: str  # one of STORAGE_CHOICES
    generation: Generation
    topk: int
    prompts: PromptSet | None


class ShardEntry(TypedDict):
    """A finished shard, as the manifest lists it."""
    file: str
    num_samples: int
    num_tokens: int
    bytes: int
    sha256: str


class _JournaledShard(ShardEntry):
    ids: list[str]
    dropped: list[tuple[str, ...]]  # (id, reason) or (id, reason, why): the samples left out


class JournaledShard(_JournaledShard, total=False):
    """A finished shard, as its rank's journal lists it: its samples' ids, those left out, and capture's notes."""
    notes: list[AnswerNote | None]  # by sample, where any sample has one


class Journal(TypedDict):
    """journal-rNNN.json: one rank's settings and the shards it finished."""
    rank: int
    settings: StoreSettings
    shards: list[JournaledShard]


class AnswerNote(TypedDict, total=False):
    """What capture says of one answer (stages/capture/responses.answer_note): its request's constraint kind, why
    it ended, and what checking it found (`constraints.check_answer`: "problem", or "unchecked" and why)."""
    constraint: str
    ended: str | None
    problem: str | None  # None: valid under its structured constraint
    unchecked: str


class AnswerCounts(TypedDict):
    """The manifest's `answers` (store.writer.answer_counts)."""
    constraint: dict[str, int]  # stored answers by constraint kind
    ended: dict[str, int]  # ... by why they ended
    structured_checked: int
    structured_invalid: dict[str, str]  # id -> why
    structured_unchecked: dict[str, str]  # id -> why no check ran


class Manifest(StoreSettings, total=False):
    """manifest.json of a finished store (store.writer.finalize_store): its settings, then what it holds; a store
    written before a key was recorded lacks it (store.reader.REQUIRED_KEYS are always there)."""
    format: str  # FORMAT
    format_version: int
    kind: str  # `store_kind`
    num_samples: int
    num_tokens: int
    dropped: dict[str, int]  # samples left out, by reason
    dropped_ids: dict[str, list[str]]  # ... their ids
    dropped_why: dict[str, str]  # the dropped samples recorded with their own reason (id: why)
    num_dropped_nonfinite: int
    answers: AnswerCounts
    bytes: int
    floor_bytes_per_token: int
    bytes_per_token: float | None
    shards: list[ShardEntry]
    ingest_report: IngestReport | None
    capture: StageConfig  # the capture's options, world size, prompts and precision


class _Tokens(TypedDict):
    input_ids: torch.Tensor  # int64 [S]
    loss_mask: torch.Tensor  # bool [S]: the target's response tokens


class SampleTensors(_Tokens, total=False):
    """A sample's tensors, what the objective reads: its tokens, and the tapped states where the store holds them
    ([S, n*H]; training computes them for a token-only store) and the top-k where it was captured with them
    (topk_ids int64, topk_logprobs float32, [S, K])."""
    hidden_states: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor


class Sample(SampleTensors):
    """One sample as a store reads it (store.reader.Store)."""
    id: str
    weight: int


def holds_states(manifest: StoreSettings) -> bool:
    """Whether a store (its manifest, or a writer's settings) holds the tapped hidden states: THE test for a
    token-only store."""
    return manifest["storage_dtype"] != NO_STATES


def store_kind(manifest: StoreSettings) -> str:
    """The manifest's `kind`: "states" (tapped hidden states stored) or "tokens" (a token-only store)."""
    return "states" if holds_states(manifest) else "tokens"


def floor_bytes_per_token(settings: StoreSettings) -> int:
    """The payload per token a store cannot do without: its states (n*H values) and top-k; for a token-only store,
    the token id and loss mask. Shards add the offsets, weights, fp8 scales and headers on top."""
    states = settings["num_tapped"] * settings["hidden_size"] * BYTES_PER_VALUE[settings["storage_dtype"]]
    return (states if holds_states(settings) else BYTES_PER_TOKEN_ID) + settings["topk"] * BYTES_PER_TOPK


def shard_name(rank: int, index: int) -> str:
    return f"shard-r{rank:03d}-{index:05d}.safetensors"


def journal_name(rank: int) -> str:
    return f"journal-r{rank:03d}.json"


def quantize_fp8(states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, D] -> (float8_e4m3fn [T, D], float32 scales [T]) with one scale per token (row amax maps to 448)."""
    x = states.float()
    amax = x.abs().amax(dim=-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scales[:, None]).to(torch.float8_e4m3fn), scales


@functools.lru_cache(maxsize=1)
def _fp8_values() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bit patterns."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    if q.device.type == "cpu":  # a table lookup is ~2x faster than torch's fp8 -> float cast on CPU
        x = torch.from_numpy(np.take(_fp8_values(), q.contiguous().view(torch.uint8).numpy()))
    else:
        x = q.float()
    return x.mul_(scales.float()[:, None]).to(dtype)


def is_store_folder(out: Path) -> bool:
    """A folder a capture wrote before folders recorded their stage: it has a journal or a store manifest."""
    return any(out.glob("journal-r*.json")) or (out / MANIFEST).exists()


def read_json(path: Path) -> Any:
    """A journal or manifest; a UserError naming the file when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}") from None
