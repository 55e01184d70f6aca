"""Writing a capture store (the format: store/format.py): `StoreWriter` appends samples shard by shard, each rank
journaling the shards it finished (a killed capture resumes from them); `finalize_store` merges the journals into
manifest.json and marks the folder complete."""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch

from dflash_train.errors import UserError, write_error
from dflash_train.provenance import (OutputClaim, complete_output, config_differences, remember_sha256, sha256_file,
                                     shown_pair, start_output, write_json_atomic, write_provenance)
from dflash_train.store.format import (BYTES_PER_TOKEN_ID, BYTES_PER_TOPK, BYTES_PER_VALUE, FORMAT, FORMAT_VERSION,
                                       MANIFEST, STAGE, STORAGE_CHOICES, STORAGE_DTYPES, TOPK_LOGPROB_DTYPE,
                                       AnswerCounts, AnswerNote, Generation, Journal, JournaledShard, Manifest,
                                       StoreSettings, floor_bytes_per_token, holds_states, is_store_folder,
                                       journal_name, quantize_fp8, read_json, shard_name, store_kind)

if TYPE_CHECKING:
    from dflash_train.prompts import IngestReport, PromptSet
    from dflash_train.provenance import StageConfig
    from dflash_train.target import TargetRecord

DEFAULT_SHARD_BYTES = 1 << 30
# writer settings added after the first stores were written, with the value those stores implicitly have
SETTING_DEFAULTS = {"topk": 0}
# ... and those that older stores did not record at all: not compared when a journal lacks them
UNRECORDED_BEFORE = ("prompts",)

# what a failed shard, journal or manifest write leaves, and what to do (errors.write_error's advice)
WRITE_ADVICE = ("Nothing half-written was kept. Free space (or make the folder writable) and rerun the same command: "
                "finished shards are kept and the capture resumes")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    dropped: list[tuple[str, ...]] = field(default_factory=list)  # (id, reason) or (id, reason, why)
    notes: list[AnswerNote | None] = field(default_factory=list)  # capture's note on each answer, or None
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
    ranks open their writers after rank 0's (stages/capture/command.py does it in that order).
    """

    def __init__(self, out_dir: str | Path, *, target: TargetRecord, target_layer_ids: list[int],
                 hidden_size: int, storage_dtype: str = "bf16", generation: Generation | None = None,
                 ingest_report: IngestReport | None = None, shard_bytes: int = DEFAULT_SHARD_BYTES,
                 rank: int = 0, world_size: int = 1, extra: dict[str, StageConfig] | None = None, topk: int = 0,
                 prompts: PromptSet | None = None):
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
        self.settings: StoreSettings = {
            "target": target,
            "target_layer_ids": [int(i) for i in target_layer_ids],
            "hidden_size": int(hidden_size),
            "num_tapped": len(target_layer_ids),
            "storage_dtype": storage_dtype,
            "generation": generation or {},
            "topk": self.topk,
            "prompts": prompts,  # the prompt set: {source, split, eval_fraction, seed} (prompts.prompt_set)
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
            journal = read_json(path)
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

    def _load_own_journal(self) -> Journal:
        path = self.out / journal_name(self.rank)
        journal: Journal = read_json(path) if path.exists() else {"rank": self.rank, "settings": self.settings,
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
        journals = [self._journal] + [read_json(p) for p in self.out.glob("journal-r*.json")
                                      if p.name != journal_name(self.rank)]
        for journal in journals:
            for entry in journal["shards"]:
                done.update(entry["ids"])
                done.update(i for i, *_ in entry["dropped"])
        return done

    # appending ---------------------------------------------------------------------------------------
    def add(self, input_ids: torch.Tensor, loss_mask: torch.Tensor, hidden_states: torch.Tensor | None, id: str,
            weight: int = 1, topk_ids: torch.Tensor | None = None,
            topk_logprobs: torch.Tensor | None = None, note: AnswerNote | None = None) -> bool:
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

    def skip(self, id: str, reason: str, why: str | None = None) -> None:
        """Record that sample `id` is left out (and why: the `reason` it is counted under in the manifest, with
        `why` its own words there, in `dropped_why`), not redone on resume."""
        id = str(id)
        if id in self.done_ids:
            raise ValueError(f"sample id {id!r} is already in store {self.out}")
        self.done_ids.add(id)
        self._pending.dropped.append((id, reason) if why is None else (id, reason, why))

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
        entry: JournaledShard = {"file": name, "num_samples": len(p.ids), "num_tokens": int(offsets[-1]),
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

    def close(self, finalize: bool = True) -> Manifest | None:
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



def finalize_store(out_dir: str | Path, ingest_report: IngestReport | None = None,
                   extra: dict[str, StageConfig] | None = None) -> Manifest:
    """Merge every rank's journal into manifest.json, write provenance and mark the folder complete; `extra`: more
    manifest keys (capture's: {"capture": its options})."""
    out = Path(out_dir)
    journals: list[Journal] = [read_json(p) for p in sorted(out.glob("journal-r*.json"))]
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
    dropped_why: dict[str, str] = {}
    for entry in shards:
        for id_, reason, *why in entry["dropped"]:
            dropped_ids.setdefault(reason, []).append(id_)
            dropped_why.update({id_: why[0]} if why else {})
    dropped = {reason: len(ids) for reason, ids in dropped_ids.items()}
    settings = {**SETTING_DEFAULTS, **settings}
    floor = floor_bytes_per_token(settings)
    shard_bytes = sum(e["bytes"] for e in shards)
    manifest: Manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        **settings,
        "kind": store_kind(settings),
        "num_samples": sum(e["num_samples"] for e in shards),
        "num_tokens": num_tokens,
        "dropped": dropped,
        "dropped_ids": dropped_ids,
        "dropped_why": dropped_why,  # the dropped samples recorded with their own reason (id: why)
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
        write_provenance(out, config={k: v for k, v in manifest.items()
                                      if k not in ("shards", "dropped_ids", "dropped_why")}, stage=STAGE)
    except OSError as err:
        for tmp in out.glob("*.json.tmp"):
            tmp.unlink()
        path.unlink(missing_ok=True)
        if user := write_error(err, path, WRITE_ADVICE):
            raise user from None
        raise
    complete_output(out)
    return manifest


def answer_counts(shards: list[JournaledShard]) -> AnswerCounts:
    """The manifest's `answers`: the stored answers by constraint kind and by why they ended, and those under a
    structured constraint that ended by themselves: how many were checked, which of those are not valid under it
    (id: why), and which no check could run on (id: why; never counted as valid)."""
    by_kind: Counter = Counter()
    ended: Counter = Counter()
    checked, invalid, unchecked = 0, {}, {}
    for entry in shards:
        for id_, note in zip(entry["ids"], entry.get("notes") or [None] * len(entry["ids"])):
            note = note or {}
            by_kind[note.get("constraint") or "none"] += 1
            ended[note.get("ended") or "unknown"] += 1
            if "problem" in note:
                checked += 1
                if note["problem"]:
                    invalid[id_] = note["problem"]
            elif "unchecked" in note:
                unchecked[id_] = note["unchecked"]
    return {"constraint": dict(by_kind), "ended": dict(ended), "structured_checked": checked,
            "structured_invalid": invalid, "structured_unchecked": unchecked}
