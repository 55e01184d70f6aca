"""The capture store: a few large safetensors shards plus a manifest.json, read with memory-mapped random access.

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
open a store (`check_hashes`); what was verified is remembered per shard (provenance.known_sha256: size, mtime, inode), so
a rerun hashes only shards that changed.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from dflash_train.errors import UserError, write_error
from dflash_train.provenance import (INCOMPLETE_MARKER, OutputClaim, check_made_by, complete_output,
                                     config_differences, known_sha256, remember_sha256, sha256_file, shown_pair,
                                     start_output, write_json_atomic, write_provenance)

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
DEFAULT_SHARD_BYTES = 1 << 30
# float16 log-probs: values lie in about [-40, 0], where float16 keeps 11 significant bits (an error of at most
# 0.0005 nats for log-probs above -1, the tokens that carry the soft label); bfloat16 would be 8x coarser for the
# same 2 bytes, float32 twice the bytes for no measurable gain. -inf (no prediction) is representable.
TOPK_LOGPROB_DTYPE = torch.float16
BYTES_PER_TOPK = 4 + 2  # int32 id + float16 log-prob
STAGE = "capture"
# what a Ctrl-C leaves in `dflash-train verify`, this module's command (errors.run_as_command prints it)
INTERRUPTED = "verify only reads the store: nothing was changed; rerun the same command to verify"
# writer settings added after the first stores were written, with the value those stores implicitly have
SETTING_DEFAULTS = {"topk": 0}
# ... and those that older stores did not record at all: not compared when a journal lacks them
UNRECORDED_BEFORE = ("prompts",)


def holds_states(manifest: dict[str, Any]) -> bool:
    """Whether a store (its manifest, or a writer's settings) holds the tapped hidden states: THE test for a
    token-only store."""
    return manifest["storage_dtype"] != NO_STATES


def store_kind(manifest: dict[str, Any]) -> str:
    """The manifest's `kind`: "states" (tapped hidden states stored) or "tokens" (a token-only store)."""
    return "states" if holds_states(manifest) else "tokens"


def floor_bytes_per_token(settings: dict[str, Any]) -> int:
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


# what a failed shard, journal or manifest write leaves, and what to do (errors.write_error's advice)
WRITE_ADVICE = ("Nothing half-written was kept. Free space (or make the folder writable) and rerun the same command: "
                "finished shards are kept and the capture resumes")


def is_store_folder(out: Path) -> bool:
    """A folder a capture wrote before folders recorded their stage: it has a journal or a store manifest."""
    return any(out.glob("journal-r*.json")) or (out / MANIFEST).exists()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------- writing

@dataclass
class _Pending:
    """Samples buffered for the next shard."""
    ids: list[str] = field(default_factory=list)
    weights: list[int] = field(default_factory=list)
    input_ids: list[torch.Tensor] = field(default_factory=list)
    loss_mask: list[torch.Tensor] = field(default_factory=list)
    states: list[torch.Tensor] = field(default_factory=list)
    scales: list[torch.Tensor] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    topk_logprobs: list[torch.Tensor] = field(default_factory=list)
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (id, reason)
    notes: list[dict[str, Any] | None] = field(default_factory=list)  # capture's note on each answer, or None
    nbytes: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.input_ids)


class StoreWriter:
    """Appends samples to a store folder, shard by shard; resumable.

        with StoreWriter(out, target=identity, target_layer_ids=[1, 3, 5], hidden_size=64) as writer:
            writer.add(input_ids, loss_mask, hidden_states, id="p1", weight=1)

    `hidden_states` is [S, len(target_layer_ids) * hidden_size], or None in a token-only store (storage_dtype
    "none"). Leaving the `with` block (or `close()`) flushes the last shard and, with `finalize=True` (the
    default), writes manifest.json and marks the folder complete.
    Under several processes every rank opens its own writer (rank=, world_size=), closes it with
    `finalize=False`, and rank 0 calls `finalize_store(out)` after a barrier.

    With `topk=K > 0` every sample also carries the target's top-K ids and log-probabilities per position
    (`add(..., topk_ids=[S, K], topk_logprobs=[S, K])`).

    Reopening a folder that a killed writer left behind resumes it: `done_ids` holds every sample id already
    stored (or dropped) by any rank, so the caller skips those and the store ends with each id exactly once.
    The settings (target, layers, dtype, generation, the prompt set `prompts`) must match the ones the folder was
    started with: a store holds one set (another split or prompt source is refused, naming the key that differs).

    Rank 0 claims the folder (provenance.OutputClaim: a folder another stage or someone else wrote is refused, and
    it is locked until `close`/`release`, so a second capture into it is refused while this one runs); the other
    ranks open their writers after rank 0's (capture.py does it in that order).
    """

    def __init__(self, out_dir: str | Path, *, target: dict[str, Any], target_layer_ids: list[int],
                 hidden_size: int, storage_dtype: str = "bf16", generation: dict[str, Any] | None = None,
                 ingest_report: dict[str, Any] | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 rank: int = 0, world_size: int = 1, extra: dict[str, Any] | None = None, topk: int = 0,
                 prompts: dict[str, Any] | None = None):
        if storage_dtype not in STORAGE_CHOICES:
            raise UserError(f"storage dtype {storage_dtype!r} is not one of {', '.join(STORAGE_CHOICES)}")
        if topk < 0:
            raise UserError(f"top-k {topk} must be >= 0 (0 = no soft labels stored)")
        self.topk = int(topk)
        self.out = Path(out_dir)
        self.rank = rank
        self.world_size = world_size
        self.storage_dtype = storage_dtype
        self.shard_bytes = max(1, int(shard_bytes))
        self.width = len(target_layer_ids) * hidden_size
        self.settings = {
            "target": target,
            "target_layer_ids": [int(i) for i in target_layer_ids],
            "hidden_size": int(hidden_size),
            "num_tapped": len(target_layer_ids),
            "storage_dtype": storage_dtype,
            "generation": generation or {},
            "topk": self.topk,
            "prompts": prompts,  # the prompt set: {source, split, eval_fraction, seed} (capture.prompt_set)
        }
        self.ingest_report = ingest_report
        self.extra = extra or {}
        self._pending = _Pending()
        self._in_batch = False
        self._closed = False
        self._claim = OutputClaim(self.out, STAGE, legacy=is_store_folder) if rank == 0 else None
        try:
            # before touching anything: a rerun with other settings must not harm the store
            self._check_settings_of_other_journals()
            if rank == 0:
                start_output(self.out, STAGE)
                if (self.out / MANIFEST).exists():  # a finished store being extended or rerun: rewritten at the end
                    (self.out / MANIFEST).unlink()
            elif not self.out.is_dir():
                raise UserError(f"store folder {self.out} does not exist: rank 0 creates it before rank {rank} "
                                f"opens its writer")
            self._journal = self._load_own_journal()
            self.done_ids = self._all_done_ids()
        except BaseException as err:
            self.release(failed=True)
            if isinstance(err, OSError) and (user := write_error(err, self.out, WRITE_ADVICE)):
                raise user from None
            raise

    def release(self, failed: bool = False) -> None:
        """Give up the folder's lock (rank 0; `close` does it after the manifest is written). Idempotent."""
        if self._claim is not None:
            self._claim.release(failed=failed)
            self._claim = None

    # resume ------------------------------------------------------------------------------------------
    def _check_settings_of_other_journals(self) -> None:
        for path in sorted(self.out.glob("journal-r*.json")):
            journal = _read_json(path)
            started = {**SETTING_DEFAULTS, **journal.get("settings", {})}
            mine = {k: v for k, v in self.settings.items() if k in started or k not in UNRECORDED_BEFORE}
            differences = config_differences(started, mine)
            if differences:
                key, old, new = differences[0]
                old_text, new_text = shown_pair(old, new)
                what = ("another prompt set: eval prompts must never join a store of training prompts (or prompts "
                        "of another source)" if key.split(".")[0] == "prompts" else "different settings")
                more = f" (and {len(differences) - 1} more difference(s))" if len(differences) > 1 else ""
                raise UserError(
                    f"store {self.out} was started with {what}: {key!r} is {old_text} in {path.name}, "
                    f"{new_text} in this run{more}; use a new --out folder or the same settings")

    def _load_own_journal(self) -> dict[str, Any]:
        path = self.out / journal_name(self.rank)
        journal = _read_json(path) if path.exists() else {"rank": self.rank, "settings": self.settings,
                                                            "shards": []}
        for key in UNRECORDED_BEFORE:  # a store from before a setting was recorded records it from now on
            journal["settings"].setdefault(key, self.settings[key])
        kept = []
        for entry in journal["shards"]:
            shard = self.out / entry["file"]
            if shard.exists() and shard.stat().st_size == entry["bytes"]:
                kept.append(entry)
            else:
                print(f"store {self.out}: shard {entry['file']} is missing or has the wrong size; its samples "
                      f"will be captured again", flush=True)
        journal["shards"] = kept
        listed = {entry["file"] for entry in kept}
        # A shard renamed just before a kill but never journaled, and temporary files, are redone.
        for path_ in self.out.glob(f"shard-r{self.rank:03d}-*"):
            if path_.name not in listed:
                path_.unlink()
        self._next_index = 1 + max((int(e["file"].split("-")[2].split(".")[0]) for e in kept), default=-1)
        return journal

    def _all_done_ids(self) -> set[str]:
        done: set[str] = set()
        journals = [self._journal] + [_read_json(p) for p in self.out.glob("journal-r*.json")
                                      if p.name != journal_name(self.rank)]
        for journal in journals:
            for entry in journal["shards"]:
                done.update(entry["ids"])
                done.update(i for i, _ in entry["dropped"])
        return done

    # appending ---------------------------------------------------------------------------------------
    def add(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden_states: torch.Tensor | None, id: str,
            weight: int = 1, topk_ids: torch.Tensor | None = None,
            topk_logprobs: torch.Tensor | None = None, note: dict[str, Any] | None = None) -> bool:
        """Buffer one sample; returns False (and counts it) when its states hold NaN/inf (or its top-k log-probs
        NaN/+inf) and it was dropped. `topk_ids`/`topk_logprobs` [S, K] are required iff the writer has topk=K;
        `note` is what capture says of the answer (its constraint kind, why it ended, its validity), journaled
        beside its id and counted in the manifest's `answers`;
        `hidden_states` is None iff the store is token-only."""
        if self._closed:
            raise RuntimeError("StoreWriter is closed")
        id = str(id)
        if id in self.done_ids:
            raise ValueError(f"sample id {id!r} is already in store {self.out}")
        n = int(input_ids.shape[0])
        states = holds_states(self.settings)
        shape = None if hidden_states is None else tuple(hidden_states.shape)
        if n == 0 or loss_mask.shape != (n,) or shape != ((n, self.width) if states else None):
            raise ValueError(f"sample {id!r}: input_ids {tuple(input_ids.shape)}, loss_mask "
                             f"{tuple(loss_mask.shape)} and hidden_states {shape} do not match [S], [S], "
                             f"{f'[S, {self.width}]' if states else 'None (a token-only store)'} with S > 0")
        self._check_topk(id, n, topk_ids, topk_logprobs)
        if (states and not torch.isfinite(hidden_states).all()) or (
                self.topk and bool((topk_logprobs.isnan() | (topk_logprobs == float("inf"))).any())):
            self.skip(id, "nonfinite")
            return False
        self.done_ids.add(id)
        p = self._pending
        p.ids.append(id)
        p.notes.append(note)
        p.weights.append(int(weight))
        p.input_ids.append(input_ids.detach().to("cpu", torch.int32))
        p.loss_mask.append(loss_mask.detach().to("cpu", torch.bool))
        if self.storage_dtype == "fp8":
            q, scales = quantize_fp8(hidden_states.detach().to("cpu"))
            p.states.append(q)
            p.scales.append(scales)
        elif states:
            p.states.append(hidden_states.detach().to("cpu", torch.bfloat16))
        if self.topk:
            p.topk_ids.append(topk_ids.detach().to("cpu", torch.int32))
            p.topk_logprobs.append(topk_logprobs.detach().to("cpu", TOPK_LOGPROB_DTYPE))
        p.nbytes += n * (self.width * BYTES_PER_VALUE[self.storage_dtype] + BYTES_PER_TOKEN_ID
                         + (4 if self.storage_dtype == "fp8" else 0) + self.topk * BYTES_PER_TOPK)
        if not self._in_batch:
            self._flush_if_full()
        return True

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Samples added inside the block share a shard: a shard that fills up closes after the block, not inside
        it (capture adds a batch at a time, so that a killed capture resumes at a batch boundary). A block left by
        an exception closes no shard."""
        self._in_batch = True
        try:
            yield
        finally:
            self._in_batch = False
        self._flush_if_full()

    def _flush_if_full(self) -> None:
        if self._pending.nbytes >= self.shard_bytes:
            self.flush()

    def _check_topk(self, id: str, n: int, topk_ids: torch.Tensor | None,
                    topk_logprobs: torch.Tensor | None) -> None:
        if not self.topk:
            if topk_ids is not None or topk_logprobs is not None:
                raise ValueError(f"sample {id!r}: top-k given to a store writer opened with topk=0")
            return
        shape = (n, self.topk)
        if topk_ids is None or topk_logprobs is None or topk_ids.shape != shape or topk_logprobs.shape != shape:
            raise ValueError(f"sample {id!r}: topk_ids {None if topk_ids is None else tuple(topk_ids.shape)} and "
                             f"topk_logprobs {None if topk_logprobs is None else tuple(topk_logprobs.shape)} do "
                             f"not match [S, K] = {list(shape)}")

    def skip(self, id: str, reason: str) -> None:
        """Record that sample `id` is left out (and why): counted in the manifest, and not redone on resume."""
        id = str(id)
        if id in self.done_ids:
            raise ValueError(f"sample id {id!r} is already in store {self.out}")
        self.done_ids.add(id)
        self._pending.dropped.append((id, reason))

    def flush(self) -> None:
        """Write the buffered samples as one shard (tmp name, fsync, sha256, rename), then journal it."""
        p = self._pending
        if not p.ids and not p.dropped:
            return
        name = shard_name(self.rank, self._next_index)
        final, tmp = self.out / name, self.out / (name + ".tmp")
        lengths = torch.tensor([len(t) for t in p.input_ids], dtype=torch.int64)
        offsets = torch.zeros(len(p.ids) + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        tensors = {
            "input_ids": torch.cat(p.input_ids) if p.ids else torch.zeros(0, dtype=torch.int32),
            "loss_mask": torch.cat(p.loss_mask) if p.ids else torch.zeros(0, dtype=torch.bool),
            "offsets": offsets,
            "weights": torch.tensor(p.weights, dtype=torch.int64),
        }
        if holds_states(self.settings):
            tensors["hidden_states"] = (torch.cat(p.states) if p.ids
                                        else torch.zeros(0, self.width, dtype=STORAGE_DTYPES[self.storage_dtype]))
        if self.storage_dtype == "fp8":
            tensors["scales"] = torch.cat(p.scales) if p.ids else torch.zeros(0, dtype=torch.float32)
        if self.topk:
            tensors["topk_ids"] = (torch.cat(p.topk_ids) if p.ids
                                   else torch.zeros(0, self.topk, dtype=torch.int32))
            tensors["topk_logprobs"] = (torch.cat(p.topk_logprobs) if p.ids
                                        else torch.zeros(0, self.topk, dtype=TOPK_LOGPROB_DTYPE))
        metadata = {"format": FORMAT, "ids": json.dumps(p.ids), "dropped": json.dumps(p.dropped)}
        try:
            _save_safetensors(tensors, metadata, tmp)
            digest = sha256_file(tmp)
            os.replace(tmp, final)
            _fsync_dir(self.out)
            remember_sha256({final: digest})  # hashed as written: no need to hash it again on this machine
        except Exception as err:  # OSError, or safetensors' SafetensorError around the OS error
            tmp.unlink(missing_ok=True)
            if user := write_error(err, tmp, WRITE_ADVICE):
                raise user from None
            raise
        entry = {"file": name, "num_samples": len(p.ids), "num_tokens": int(offsets[-1]),
                 "bytes": final.stat().st_size, "sha256": digest, "ids": p.ids, "dropped": p.dropped}
        if any(n is not None for n in p.notes):
            entry["notes"] = p.notes
        self._journal["shards"].append(entry)
        self._write_json(self.out / journal_name(self.rank), self._journal)
        self._next_index += 1
        self._pending = _Pending()

    def _write_json(self, path: Path, obj: Any) -> None:
        try:
            write_json_atomic(path, obj)
        except OSError as err:
            path.with_name(path.name + ".tmp").unlink(missing_ok=True)
            if user := write_error(err, path, WRITE_ADVICE):
                raise user from None
            raise

    def close(self, finalize: bool = True) -> dict[str, Any] | None:
        """Flush the last shard; with finalize (single process, or rank 0 after a barrier) write the manifest."""
        if self._closed:
            return None
        self.flush()
        self._closed = True
        if finalize:
            manifest = finalize_store(self.out, ingest_report=self.ingest_report, extra=self.extra)
            self.release()
            return manifest
        return None

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.close()
        finally:
            self.release()


def _save_safetensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path) -> None:
    """A shard whose bytes depend on its contents only: safetensors writes the metadata keys in a hash map's order,
    random per process (two captures of the same samples gave shards of different sha256), so the header is
    rewritten in place with the keys sorted (the same bytes, in another order: the same length)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    with open(path, "r+b") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
        ordered = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(ordered) <= size:  # (always: the same characters) padded with spaces as safetensors pads it
            f.seek(8)
            f.write(ordered.ljust(size))
        os.fsync(f.fileno())


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read {path}: {err}") from None


def finalize_store(out_dir: str | Path, ingest_report: dict[str, Any] | None = None,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Merge every rank's journal into manifest.json, write provenance and mark the folder complete."""
    out = Path(out_dir)
    journals = [_read_json(p) for p in sorted(out.glob("journal-r*.json"))]
    if not journals:
        raise UserError(f"store {out} has no journal-r*.json: nothing was captured into it")
    settings = journals[0]["settings"]
    shards = [entry for journal in journals for entry in journal["shards"]]
    referenced = {entry["file"] for entry in shards}
    for path in out.glob("shard-r*"):  # leftovers of a rank that was killed and not rerun with this rank
        if path.name not in referenced:
            path.unlink()
    num_tokens = sum(e["num_tokens"] for e in shards)
    dropped_ids: dict[str, list[str]] = {}
    for entry in shards:
        for id_, reason in entry["dropped"]:
            dropped_ids.setdefault(reason, []).append(id_)
    dropped = {reason: len(ids) for reason, ids in dropped_ids.items()}
    settings = {**SETTING_DEFAULTS, **settings}
    floor = floor_bytes_per_token(settings)
    shard_bytes = sum(e["bytes"] for e in shards)
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **settings,
        "kind": store_kind(settings),
        "num_samples": sum(e["num_samples"] for e in shards),
        "num_tokens": num_tokens,
        "dropped": dropped,
        "dropped_ids": dropped_ids,
        "num_dropped_nonfinite": dropped.get("nonfinite", 0),
        "answers": answer_counts(shards),
        "bytes": shard_bytes,
        "floor_bytes_per_token": floor,
        "bytes_per_token": shard_bytes / num_tokens if num_tokens else None,
        "shards": [{k: e[k] for k in ("file", "num_samples", "num_tokens", "bytes", "sha256")} for e in shards],
        "ingest_report": ingest_report,
        **(extra or {}),
    }
    path = out / MANIFEST
    try:
        write_json_atomic(path, manifest)
        write_provenance(out, config={k: v for k, v in manifest.items() if k not in ("shards", "dropped_ids")},
                         stage=STAGE)
    except OSError as err:
        for tmp in out.glob("*.json.tmp"):
            tmp.unlink()
        path.unlink(missing_ok=True)
        if user := write_error(err, path, WRITE_ADVICE):
            raise user from None
        raise
    complete_output(out)
    return manifest


def answer_counts(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's `answers`: the stored answers by constraint kind and by why they ended, and those under a
    structured constraint that ended by themselves: how many, and which are not valid under it (id: why)."""
    by_kind: Counter = Counter()
    ended: Counter = Counter()
    checked, invalid = 0, {}
    for entry in shards:
        for id_, note in zip(entry["ids"], entry.get("notes") or [None] * len(entry["ids"])):
            note = note or {}
            by_kind[note.get("constraint") or "none"] += 1
            ended[note.get("ended") or "unknown"] += 1
            if "problem" in note:
                checked += 1
                if note["problem"]:
                    invalid[id_] = note["problem"]
    return {"constraint": dict(by_kind), "ended": dict(ended), "structured_checked": checked,
            "structured_invalid": invalid}


# --------------------------------------------------------------------------------------------------- reading

@dataclass
class _Shard:
    path: Path
    ids: list[str]
    offsets: torch.Tensor  # int64 [N+1]
    weights: torch.Tensor  # int64 [N]


class Store(Sequence):
    """A read-only store: `store[i]` -> {input_ids, loss_mask, hidden_states, id, weight} (no hidden_states in a
    token-only store), plus topk_ids (int64 [S, K]) and topk_logprobs (float32 [S, K]) when the store was captured
    with --store-topk K; memory-mapped.

    Each item reads only its own token range from its shard (safetensors slices over an mmap), so random
    access costs the sample's bytes, not the shard's. Safe to use from DataLoader workers: file handles are
    opened lazily per process."""

    def __init__(self, root: Path, manifest: dict[str, Any], shards: list[_Shard]):
        self.root = root
        self.manifest = manifest
        self._shards = shards
        self._starts = [0]
        for shard in shards:
            self._starts.append(self._starts[-1] + len(shard.ids))
        self._handles: dict[int, Any] = {}
        self._pid = os.getpid()
        self.fp8 = manifest["storage_dtype"] == "fp8"
        self.has_states = holds_states(manifest)
        self.topk = int(manifest.get("topk", 0))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}

    def _locate(self, index: int) -> tuple[int, int]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"sample index {index} out of range for a store of {len(self)}")
        s = bisect.bisect_right(self._starts, index) - 1
        return s, index - self._starts[s]

    def _handle(self, s: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # forked into a worker: mmaps are not shared safely, reopen
            self._handles, self._pid = {}, os.getpid()
        if s not in self._handles:
            self._handles[s] = safe_open(str(self._shards[s].path), framework="pt")
        return self._handles[s]

    def length(self, index: int) -> int:
        """Token count of sample `index` without reading it (for length-bucketed batching)."""
        s, j = self._locate(index)
        offsets = self._shards[s].offsets
        return int(offsets[j + 1] - offsets[j])

    @property
    def ids(self) -> list[str]:
        return [i for shard in self._shards for i in shard.ids]

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        s, j = self._locate(index)
        shard = self._shards[s]
        a, b = int(shard.offsets[j]), int(shard.offsets[j + 1])
        f = self._handle(s)
        item = {
            "input_ids": f.get_slice("input_ids")[a:b].long(),
            "loss_mask": f.get_slice("loss_mask")[a:b].bool(),
            "id": shard.ids[j],
            "weight": int(shard.weights[j]),
        }
        if self.has_states:
            states = f.get_slice("hidden_states")[a:b]
            item["hidden_states"] = dequantize_fp8(states, f.get_slice("scales")[a:b]) if self.fp8 else states
        if self.topk:
            item["topk_ids"] = f.get_slice("topk_ids")[a:b].long()
            item["topk_logprobs"] = f.get_slice("topk_logprobs")[a:b].float()
        return item

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for i in range(len(self)):
            yield self[i]


REQUIRED_KEYS = ("format", "target", "target_layer_ids", "hidden_size", "num_tapped", "storage_dtype",
                 "generation", "num_samples", "num_tokens", "shards")


def _load_manifest(root: Path) -> dict[str, Any]:
    if not root.exists():
        raise UserError(f"store {root} does not exist (run `dflash-train capture --out {root}` first)")
    if not root.is_dir():
        raise UserError(f"store {root} is a file: a store is the folder `dflash-train capture --out` writes")
    check_made_by(root, STAGE)
    if (root / INCOMPLETE_MARKER).exists() or (not (root / MANIFEST).exists() and is_store_folder(root)):
        raise UserError(f"store {root} is incomplete (no manifest.json, or an {INCOMPLETE_MARKER} marker): "
                        f"rerun the capture command that wrote it to finish it")
    if not (root / MANIFEST).exists():
        raise UserError(f"{root} is not a capture store (no {MANIFEST}): pass a folder `dflash-train capture --out` "
                        f"wrote")
    manifest = _read_json(root / MANIFEST)
    missing = [k for k in REQUIRED_KEYS if k not in manifest] if isinstance(manifest, dict) else list(REQUIRED_KEYS)
    if missing or manifest.get("format") != FORMAT:
        raise UserError(f"{root / MANIFEST} is not a {FORMAT} manifest (missing keys: {', '.join(missing)})")
    if problem := _manifest_problem(manifest):
        raise UserError(f"{root / MANIFEST}: {problem}")
    if manifest["storage_dtype"] not in STORAGE_CHOICES:
        raise UserError(f"{root / MANIFEST}: unknown storage_dtype {manifest['storage_dtype']!r}")
    topk = manifest.get("topk", 0)
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 0:
        raise UserError(f"{root / MANIFEST}: 'topk' must be an integer >= 0, got {topk!r}")
    return manifest


def _manifest_problem(manifest: dict[str, Any]) -> str | None:
    """What is wrong with the values the readers take from a manifest (a hand-edited or damaged one), or None."""
    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    for key in ("hidden_size", "num_tapped", "num_samples", "num_tokens"):
        if not count(manifest[key]):
            return f"{key!r} must be an integer >= 0, got {manifest[key]!r}"
    if not isinstance(manifest["target_layer_ids"], list) or not all(map(count, manifest["target_layer_ids"])):
        return f"'target_layer_ids' must be a list of layer numbers, got {manifest['target_layer_ids']!r}"
    if not isinstance(manifest["shards"], list):
        return f"'shards' must be a list, got {type(manifest['shards']).__name__}"
    for i, entry in enumerate(manifest["shards"]):
        if not isinstance(entry, dict):
            return f"shards[{i}] is not an object"
        name = entry.get("file")
        if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
            return f"shards[{i}] 'file' must be a file name inside the store, got {name!r}"
        for key in ("num_samples", "num_tokens", "bytes"):
            if not count(entry.get(key)):
                return f"shards[{i}] ({name}) {key!r} must be an integer >= 0, got {entry.get(key)!r}"
        if not isinstance(entry.get("sha256"), str):
            return f"shards[{i}] ({name}) has no 'sha256' string"
    return None


def _read_shard(root: Path, entry: dict[str, Any], manifest: dict[str, Any]) -> _Shard:
    """Open one shard's header and index, checking it against its manifest entry (size, counts, shapes)."""
    from safetensors import SafetensorError, safe_open

    path = root / entry["file"]
    if not path.exists():
        raise UserError(f"store {root}: shard {entry['file']} is missing")
    if path.stat().st_size != entry["bytes"]:
        raise UserError(f"store {root}: shard {entry['file']} has {path.stat().st_size} bytes, the manifest says "
                        f"{entry['bytes']} (truncated or replaced)")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            ids = json.loads(meta["ids"])
            offsets = f.get_tensor("offsets")
            weights = f.get_tensor("weights")
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError, KeyError, ValueError) as err:
        raise UserError(f"store {root}: shard {entry['file']} is unreadable ({type(err).__name__}: {err})") from None
    n, t = entry["num_samples"], entry["num_tokens"]
    width = manifest["num_tapped"] * manifest["hidden_size"]
    expected = {"input_ids": (t,), "loss_mask": (t,), "offsets": (n + 1,), "weights": (n,)}
    if holds_states(manifest):
        expected["hidden_states"] = (t, width)
    if manifest["storage_dtype"] == "fp8":
        expected["scales"] = (t,)
    if manifest.get("topk", 0):
        expected["topk_ids"] = expected["topk_logprobs"] = (t, manifest["topk"])
    problems = [f"{k} has shape {shapes.get(k)}, expected {v}" for k, v in expected.items() if shapes.get(k) != v]
    if len(ids) != n:
        problems.append(f"{len(ids)} ids for {n} samples")
    if n and (int(offsets[0]) != 0 or int(offsets[-1]) != t or bool((offsets[1:] <= offsets[:-1]).any())):
        problems.append("offsets are not increasing from 0 to the token count")
    if problems:
        raise UserError(f"store {root}: shard {entry['file']} does not match the manifest: {'; '.join(problems)}")
    return _Shard(path=path, ids=ids, offsets=offsets, weights=weights)


def open_store(path: str | Path) -> Store:
    """Open a finished store folder for reading. Raises UserError naming the folder (and shard) if it is
    missing, incomplete or inconsistent. Cheap: reads the manifest and each shard's header and index only;
    `dflash-train verify` re-hashes the data."""
    root = Path(path)
    manifest = _load_manifest(root)
    shards = [_read_shard(root, entry, manifest) for entry in manifest["shards"]]
    if sum(len(s.ids) for s in shards) != manifest["num_samples"]:
        raise UserError(f"store {root}: the shards hold {sum(len(s.ids) for s in shards)} samples, the manifest "
                        f"says {manifest['num_samples']}")
    return Store(root, manifest, shards)


# --------------------------------------------------------------------------------------------------- verify

def verify_store(path: str | Path) -> list[str]:
    """Every problem found in a store (empty list = sound): re-hashes each shard and checks the manifest."""
    root = Path(path)
    manifest = _load_manifest(root)
    problems: list[str] = []
    seen: set[str] = set()
    verified: dict[Path, str] = {}
    total_samples = total_tokens = 0
    from tqdm import tqdm

    for entry in tqdm(manifest["shards"], desc="verify", unit="shard", leave=False):
        name = entry["file"]
        if not (root / name).exists():
            problems.append(f"shard {name}: missing")
            continue
        if (root / name).stat().st_size != entry["bytes"]:
            problems.append(f"shard {name}: {(root / name).stat().st_size} bytes, manifest says {entry['bytes']} "
                            f"(truncated or replaced)")
            continue
        digest = sha256_file(root / name)
        if digest != entry["sha256"]:
            problems.append(f"shard {name}: sha256 {digest[:16]}... does not match the manifest's "
                            f"{entry['sha256'][:16]}... (corrupted)")
            continue
        try:
            shard = _read_shard(root, entry, manifest)
        except UserError as err:
            problems.append(str(err))
            continue
        duplicates = seen.intersection(shard.ids)
        if duplicates or len(set(shard.ids)) != len(shard.ids):
            problems.append(f"shard {name}: duplicate sample ids {sorted(duplicates)[:5]}")
        seen.update(shard.ids)
        verified[root / name] = digest
        total_samples += entry["num_samples"]
        total_tokens += entry["num_tokens"]
    if not problems and (total_samples, total_tokens) != (manifest["num_samples"], manifest["num_tokens"]):
        problems.append(f"manifest totals ({manifest['num_samples']} samples, {manifest['num_tokens']} tokens) "
                        f"differ from the shards' ({total_samples}, {total_tokens})")
    if not problems:  # training and eval need not hash these shards again while they are unchanged
        remember_sha256(verified)
    return problems


def check_hashes(path: str | Path, threads: int | None = None, rank: int = 0, world: int = 1) -> dict[str, int]:
    """Re-hash the shards of a finished store against its manifest, as training and eval do when they open one: a
    UserError names the first shard whose bytes are not the ones captured. A shard this machine verified before and
    that has not changed since (same size, mtime and inode) is not hashed again (provenance.known_sha256): the
    capture that wrote it (it hashed each shard as it wrote it), `dflash-train verify` and this check remember the
    digests they computed. Several shards are hashed at once (hashlib releases the GIL); with
    `world` > 1 this process checks only shards i with i % world == rank (the ranks of a run share the work).
    Returns {"hashed": n, "cached": m, "bytes_hashed": b}. `dflash-train verify` always re-hashes everything."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    root = Path(path)
    manifest = _load_manifest(root)
    mine = [entry for i, entry in enumerate(manifest["shards"]) if i % world == rank]
    for entry in mine:
        if not (root / entry["file"]).exists():
            raise UserError(f"store {root}: shard {entry['file']} is missing")
    known = known_sha256([root / entry["file"] for entry in mine])
    todo = [entry for entry in mine if known.get(root / entry["file"]) != entry["sha256"]]
    hashed_bytes = sum((root / entry["file"]).stat().st_size for entry in todo)
    verified = {}
    with tqdm(total=hashed_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc=f"check {root.name}",
              leave=False, disable=not todo) as bar, \
            ThreadPoolExecutor(max_workers=threads or min(8, os.cpu_count() or 1)) as pool:
        def hash_one(entry):
            shard = root / entry["file"]
            digest = sha256_file(shard)
            bar.update(shard.stat().st_size)
            return entry, digest

        for entry, digest in pool.map(hash_one, todo):
            if digest != entry["sha256"]:
                raise UserError(f"store {root}: shard {entry['file']} is corrupted (its sha256 {digest[:16]}... is not "
                                f"the manifest's {entry['sha256'][:16]}...): recapture it (rerun the capture into a "
                                f"new folder), or restore the file; `dflash-train verify {root}` lists every bad shard")
            verified[root / entry["file"]] = digest
    if verified:
        remember_sha256(verified)
    return {"hashed": len(todo), "cached": len(mine) - len(todo), "bytes_hashed": hashed_bytes}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="a store folder written by `dflash-train capture`")


def run(args: argparse.Namespace) -> int:
    problems = verify_store(args.store)
    if problems:
        for problem in problems:
            print(f"FAIL {args.store}: {problem}")
        print(f"verify {args.store}: {len(problems)} problem(s)")
        return 1
    m = _load_manifest(Path(args.store))
    size = sum(entry["bytes"] for entry in m["shards"])  # what verify_store checked, file by file
    per_token = size / m["num_tokens"] if m["num_tokens"] else 0.0
    floor = m.get("floor_bytes_per_token")
    floor = floor if isinstance(floor, (int, float)) and floor > 0 else None
    print(f"verify {args.store}: OK: {m['num_samples']} samples, {m['num_tokens']} tokens, {len(m['shards'])} "
          f"shard(s), {size / 2**20:.1f} MiB, {per_token:.1f} bytes/token"
          + (f" vs floor {floor} ({100 * (per_token / floor - 1):+.2f}%)" if floor else "")
          + ", "
          f"{m['storage_dtype'] if holds_states(m) else 'token-only (no hidden states)'}, layers "
          f"{m['target_layer_ids']}, dropped {m.get('dropped') or 'none'}")
    return 0
