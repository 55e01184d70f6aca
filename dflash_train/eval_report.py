"""The eval report (report.json): what an eval measured, as typed records, and the one place that reads and writes it.

The eval stage builds an `EvalReport` and writes it with `dump`; every reader (push's card and gate, report_tables,
runs, the demo, benchmarks, probes) reads it with `load` (or `from_json`). A key of report.json is a field name
here and is spelled nowhere else.

Versions: report.json carries `schema_version`, "MAJOR.MINOR". A minor version only adds fields: a reader ignores a
key it does not know and gives a field a file lacks its default. A major version changes what a key means or where
it sits, and a reader refuses a major it does not know, in one line. Reports written before the version was
recorded are major 0; `_migrate_v0` moves them to 1 as they are read (the only migration).

tau: the headline is `tau_steps`, the tokens committed per verification step over every step (1 + the accepted
drafts, at most B): what vLLM's own metrics give and what maps to throughput. `tau_per_prompt`, the mean over
prompts of each prompt's own mean, is a figure of the distribution: a prompt of a few long steps weighs as much as
one of many short ones (major 0 called it `tau`).
"""

from __future__ import annotations

import functools
import json
import math
import types
import typing
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from dflash_train.errors import UserError
from dflash_train.model.configuration import HfConfig
from dflash_train.provenance import StageConfig
from dflash_train.target import TargetIdentity, TemplateKwargs

SCHEMA_VERSION = "1.2"  # 1.1: RankRow.prompts; 1.2: VllmEval.baseline, baseline_sha256, against_baseline
MAJOR = SCHEMA_VERSION.split(".")[0]  # the major version this module reads (and writes)

Interval = list[float]  # [low, high]: the 95% bootstrap interval over prompts (evaluate.metrics.bootstrap_interval)

ReportJson = dict[str, Any]
"""report.json as JSON (`to_json`), or as read before it is decoded: of this schema version or of another."""


# ---- what every speculator's figures share ------------------------------------------------------------------------


@dataclass(frozen=True)
class Acceptance:
    """tau and acceptance by block position over verification steps (evaluate.metrics.acceptance_stats)."""
    tau_steps: float | None = None  # the headline: tokens committed per verification step, over every step
    tau_steps_interval: Interval | None = None
    tau_per_prompt: float | None = None  # the mean over prompts of each prompt's mean over its steps
    tau_per_prompt_interval: Interval | None = None
    per_position_acceptance: list[float | None] = field(default_factory=list)  # [k-1]: share accepting >= k drafts
    tau_histogram: dict[str, int] = field(default_factory=dict)  # tau -> steps
    num_steps: int | None = None

    def acceptance(self) -> Acceptance:
        """These figures alone (of a record that holds more)."""
        return Acceptance(**{f.name: getattr(self, f.name) for f in fields(Acceptance)})


@dataclass
class Mismatch:
    """Where a speculative output left plain decoding's (own_loop.diagnose_mismatch); the fp32 rerun fills in its
    verdict afterwards, hence not frozen."""
    id: str = ""
    index: int = 0  # the new token where they part
    plain_token: int | None = None
    spec_token: int | None = None
    top2_margin: float | None = None  # the target's top-2 logit margin there: a near-tie rounds either way
    method: str | None = None  # the project's loop: whose output
    fp32_spec_equals_plain: bool | None = None  # None: not rerun in fp32
    plain_equals_fp32_plain: bool | None = None


@dataclass(frozen=True)
class Lossless:
    """The lossless check: speculative outputs compared with plain decoding's, token by token (greedy)."""
    lossless_checked: int = 0
    lossless_mismatches: int | None = None  # None: not checked (lossless_note says why)
    lossless_mismatches_fp32: int | None = None  # of those, still different when rerun in fp32
    lossless_recheck_s: float | None = None
    lossless_note: str | None = None
    mismatches: list[Mismatch] = field(default_factory=list)

    def standing_mismatches(self) -> int | None:
        """The outputs that differ from plain decoding. In bf16 a verify forward over a whole block can round a
        near-tie differently from the one-token decode; such prompts are rerun in fp32, and the fp32 count is the one
        that says whether decoding was lossless. None: the check did not run."""
        if self.lossless_mismatches and self.lossless_mismatches_fp32 is not None:
            return self.lossless_mismatches_fp32
        return self.lossless_mismatches


@dataclass(frozen=True)
class Speed:
    """Tokens/s of both sides and the speedup, by the engine core over the whole request (prefill included: no
    suffix), over the decode phase (the tokens after the first: `_decode`) and by a stopwatch (`_wall`)."""
    tokens_per_s: float | None = None
    tokens_per_s_baseline: float | None = None
    speedup: float | None = None
    speedup_interval: Interval | None = None
    tokens_per_s_decode: float | None = None
    tokens_per_s_baseline_decode: float | None = None
    speedup_decode: float | None = None
    speedup_decode_interval: Interval | None = None
    tokens_per_s_wall: float | None = None
    tokens_per_s_baseline_wall: float | None = None
    speedup_wall: float | None = None
    speedup_wall_interval: Interval | None = None

    def speed(self) -> Speed:
        """These figures alone (of a record that holds more)."""
        return Speed(**{f.name: getattr(self, f.name) for f in fields(Speed)})


# ---- the project's loop -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodRow(Acceptance):
    """One method of the project's loop (own_loop.method_row): plain decoding, the drafter, a baseline, block size 1.
    Tokens/s are of the decode phase by the loop's own clock."""
    method: str = ""
    role: str = ""  # plain | drafter | baseline | no_speculation
    drafter: str | None = None
    block_size: int = 1
    lossless_mismatches: int | None = None
    tokens_per_target_forward: float | None = None
    decode_tokens: int = 0
    decode_s: float = 0.0
    draft_s: float = 0.0
    tokens_per_s: float | None = None
    speedup: float | None = None
    speedup_interval: Interval | None = None


@dataclass(frozen=True)
class OwnPrompt:
    id: str = ""
    prompt_tokens: int = 0
    new_tokens: int = 0
    tau: dict[str, float | None] = field(default_factory=dict)  # by method: its mean over this prompt's steps
    mismatch: list[str] = field(default_factory=list)  # the methods whose output differs from plain decoding's


@dataclass(frozen=True)
class OwnLoop(Acceptance, Lossless):
    """The project's decoding loop: the drafter's figures (the headline), every method's row, each prompt."""
    tokens_per_s: float | None = None
    tokens_per_s_baseline: float | None = None
    speedup: float | None = None
    speedup_interval: Interval | None = None
    methods: list[MethodRow] = field(default_factory=list)
    per_prompt: list[OwnPrompt] = field(default_factory=list)

    def by_role(self, role: str) -> list[MethodRow]:
        return [m for m in self.methods if m.role == role]


# ---- vLLM ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimedPrompt:
    """One prompt's timed runs at batch 1 in vLLM (vllm_sweep.k_row): the mean seconds of each side by each clock."""
    id: str = ""
    new_tokens: int = 0
    requests: int = 1
    tau: float | None = None  # the mean over its verification steps
    mismatch: bool = False
    plain_core_s: float = 0.0
    plain_decode_s: float = 0.0
    plain_wall_s: float = 0.0
    spec_core_s: float = 0.0
    spec_decode_s: float = 0.0
    spec_wall_s: float = 0.0
    plain_cached_tokens: int | None = None  # 0: prefilled in full
    spec_cached_tokens: int | None = None
    speedup: float | None = None
    speedup_decode: float | None = None
    speedup_wall: float | None = None


@dataclass(frozen=True)
class KRow(Acceptance, Speed, Lossless):
    """A speculator at one speculation length K, timed at batch 1 (vllm_sweep.k_row)."""
    k: int = 0
    step_cost: float | None = None  # a verification step's cost in plain decoding steps
    tokens_unaccounted_by_steps: int = 0
    load_s: float | None = None
    seconds: float | None = None
    repeat_spread: float | None = None
    engine_args: dict[str, Any] | None = None  # prompt lookup, suffix: its speculative config; combined: vLLM's
    per_prompt: list[TimedPrompt] = field(default_factory=list)


@dataclass(frozen=True)
class ConcurrencyRow(Speed):
    requests: int = 1
    k: int = 0


@dataclass(frozen=True)
class SpeculatorEntry(KRow):
    """A speculator beside the drafter at its fastest K (prompt lookup, suffix decoding; the baseline drafter at the
    one K it was timed at), with its concurrency runs."""
    concurrency: list[ConcurrencyRow] = field(default_factory=list)
    pays_up_to_concurrency: int | None = None


@dataclass(frozen=True)
class SourceCount:
    blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    without_drafter: int = 0  # blocks at steps that skipped the drafter's pass


@dataclass(frozen=True)
class Paired:
    """One speculator against another on the prompts both timed, paired by prompt (vllm_sweep.paired_against)."""
    prompts: int = 0
    k: int = 0  # the other's K
    tau: float | None = None  # the mean of each paired prompt's tau, this side's
    tau_other: float | None = None  # the same, the other's: tau_ratio is tau / tau_other
    tau_ratio: float | None = None
    tau_ratio_interval: Interval | None = None
    speedup_ratio: float | None = None
    speedup_ratio_interval: Interval | None = None


@dataclass(frozen=True)
class CombinedEntry(SpeculatorEntry):
    """The combined speculator (spec_decode.combined) at its K: its rule, its blocks by source, and against the
    others."""
    setting: str = ""  # the rule, as lookup.parse_combined reads it
    sources: dict[str, SourceCount] = field(default_factory=dict)
    suffix_answers_before: list[int | None] = field(default_factory=list)
    against: dict[str, Paired] = field(default_factory=dict)


@dataclass(frozen=True)
class RankRow:
    """A speculator at its fastest K in the ranking (vllm_sweep.ranking), its figures on the prompts every ranked
    speculator timed (vllm_sweep.on_prompts)."""
    speculator: str = ""
    k: int = 0
    tau_steps: float | None = None
    tau_steps_interval: Interval | None = None
    tau_per_prompt: float | None = None
    speedup: float | None = None
    speedup_interval: Interval | None = None
    lossless_mismatches: int | None = None
    prompts: int | None = None  # how many prompts these figures are of (None: written before schema 1.1)


@dataclass(frozen=True)
class FirstK:
    """The K the sweep timed first (vllm_sweep.sweep_first_k) and the estimate that chose it."""
    k: int = 0
    source: str | None = None
    slack: float = 0.0
    step_cost: list[float] | None = None


@dataclass(frozen=True)
class SweepTiming:
    """How the sweep was timed (vllm_sweep.timing_entry)."""
    protocol: str = ""
    repeats: int = 1
    budget_s: float | None = None
    measured_k: list[int] = field(default_factory=list)
    skipped_k: list[int] = field(default_factory=list)
    first_k: FirstK | None = None
    plain_tokens_per_s_decode: dict[str, float | None] = field(default_factory=dict)  # by pass: reference, K, ...
    host_drift: float | None = None
    host_drift_limit: float | None = None
    host_unsteady: bool = False
    concurrency: list[int] = field(default_factory=list)
    seconds: float | None = None
    load_average_after: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class LoadSeconds:
    plain: float | None = None
    speculative: float | None = None


@dataclass(frozen=True)
class VllmEval(Acceptance, Speed, Lossless):
    """The drafter in vLLM (vllm_sweep.engine_eval): its headline figures are those of the fastest K at batch 1
    (best_k), the K the card serves it with; the sweep, the concurrency runs and the speculators beside it."""
    version: str | None = None
    refused_by_engine: dict[str, str] = field(default_factory=dict)  # prompt id -> the engine's reason
    best_k: int | None = None
    best_k_share: float | None = None  # how often resampled prompts pick best_k
    tokens_unaccounted_by_steps: int = 0
    drafter_sha256: str | None = None  # the drafter the engine read (checkpoint.drafter_identity)
    dtype: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)  # vllm.LLM's arguments at best_k
    engine_args_plain: dict[str, Any] = field(default_factory=dict)
    serve_command: str | None = None
    load_s: LoadSeconds | None = None
    environment: dict[str, str] = field(default_factory=dict)
    sweep: list[KRow] = field(default_factory=list)
    concurrency: list[ConcurrencyRow] = field(default_factory=list)
    concurrency_best: list[ConcurrencyRow] = field(default_factory=list)
    pays_up_to_concurrency: int | None = None
    per_batch_size_schedule: list[list[int]] | None = None
    ngram: SpeculatorEntry | None = None  # vLLM's prompt lookup at its fastest K
    ngram_sweep: list[KRow] = field(default_factory=list)
    suffix: SpeculatorEntry | None = None  # vLLM's suffix decoding at its fastest K
    suffix_sweep: list[KRow] = field(default_factory=list)
    combined: CombinedEntry | None = None
    # the baseline drafter (eval --baseline-drafter: the one serving now) at the drafter's first K, timed beside it on
    # plain decoding's same runs; its lossless check counts its mismatches (no fp32 recheck: that is best_k's)
    baseline: SpeculatorEntry | None = None
    baseline_sha256: str | None = None  # the baseline drafter the engine read (checkpoint.drafter_identity)
    against_baseline: Paired | None = None  # the drafter at the baseline's K against it, paired by prompt
    ranking: list[RankRow] = field(default_factory=list)  # fastest first at batch 1
    timing: SweepTiming | None = None
    per_prompt: list[TimedPrompt] = field(default_factory=list)  # best_k's


# ---- the offline estimate, the settings, what was measured ---------------------------------------------------------


@dataclass(frozen=True)
class SampleTau:
    id: str = ""
    tau: float | None = None


@dataclass(frozen=True)
class OfflineEstimate(Acceptance):
    """The trainer's simulated acceptance on captured held-out samples, walked as greedy decoding walks them
    (evaluate.metrics.offline_estimate)."""
    tau_by_k: list[float | None] = field(default_factory=list)  # [K-1]: tau_per_prompt at speculation length K
    tau_every_anchor: float | None = None
    num_samples: int = 0
    num_anchors: int = 0
    per_sample: list[SampleTau] = field(default_factory=list)
    store: str | None = None
    samples_of_eval_prompts: int | None = None


@dataclass(frozen=True)
class Machine:
    cpu: str | None = None
    cores: int | None = None
    load_average: list[float] = field(default_factory=list)  # 1, 5, 15 min, at the eval's start
    gpu: str | None = None


@dataclass(frozen=True)
class ConstraintsSummary:
    """The prompts decoded under their requests' own constraints (evaluate.command.eval_constraints)."""
    constrained: int = 0
    of: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    decoded_without: dict[str, int] = field(default_factory=dict)  # setting -> prompts decoded without it


@dataclass(frozen=True)
class Settings:
    """How the eval ran: its flags as given (`options`: evaluate.config.EvalConfig's fields) and what it found."""
    options: StageConfig = field(default_factory=dict)
    template_kwargs: TemplateKwargs = field(default_factory=dict)
    device: str | None = None
    dtype: str | None = None
    dtype_reason: str | None = None
    block_size: int | None = None
    num_prompts: int = 0
    own_prompts: int | None = None  # the project's loop decoded the first of them (--own-limit)
    skipped_long_prompts: int = 0
    constraints: ConstraintsSummary | None = None
    threads: int | None = None
    machine: Machine | None = None
    sampling: str = "greedy"


@dataclass(frozen=True)
class HeldOutCheck:
    """What evaluate.command.check_held_out compared with the drafter's training data."""
    checked: bool = False
    why: str | None = None
    by_id: list[str] = field(default_factory=list)
    by_prompt_set: list[str] = field(default_factory=list)
    not_checked: list[str] = field(default_factory=list)
    training_prompts: int = 0  # let through by --training-prompts


@dataclass(frozen=True)
class DrafterRecord:
    """The drafter measured: its shape and what decides its outputs (checkpoint.drafter_identity)."""
    path: str | None = None
    block_size: int | None = None
    num_hidden_layers: int | None = None
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int | None = None
    draft_vocab_size: int | None = None
    num_parameters: int | None = None
    sha256: str | None = None
    weights_sha256: str | None = None
    config: HfConfig | None = None  # its config.json but for this project's records
    made_for_target: str | None = None


@dataclass(frozen=True)
class EvalReport:
    schema_version: str = SCHEMA_VERSION
    block_size: int = 0
    settings: Settings = field(default_factory=Settings)
    drafter: DrafterRecord = field(default_factory=DrafterRecord)
    baseline_drafters: list[DrafterRecord] = field(default_factory=list)
    target: TargetIdentity | None = None
    held_out_check: dict[str, HeldOutCheck] = field(default_factory=dict)  # "prompts", "store"
    own: OwnLoop | None = None  # None: the project's loop did not run (--engine vllm)
    vllm: VllmEval | None = None  # None: vLLM did not run (--engine own)
    offline: OfflineEstimate | None = None  # None: no --store

    @property
    def online(self) -> OwnLoop | VllmEval | None:
        """The online figures: the project's loop's, else vLLM's."""
        return self.own or self.vllm

    @property
    def tau_gap(self) -> float | None:
        """Online tau less the offline estimate's (both tau_steps); None without both."""
        online = self.online.tau_steps if self.online else None
        offline = self.offline.tau_steps if self.offline else None
        return online - offline if online is not None and offline is not None else None


def fields_of(*records: Any) -> dict[str, Any]:
    """The fields of records, shallow, to build a record that holds theirs: KRow(**fields_of(acceptance, speed))."""
    return {f.name: getattr(r, f.name) for r in records for f in fields(r)}


# ---- reading and writing ------------------------------------------------------------------------------------------


def to_json(report: EvalReport) -> ReportJson:
    """The report as strict JSON: NaN (a figure over nothing, e.g. no steps) is null."""
    return _finite(asdict(report))


def dump(report: EvalReport, path: Path) -> None:
    from dflash_train.provenance import write_json_atomic

    write_json_atomic(path, to_json(report))


def load(path: str | Path) -> EvalReport:
    """report.json (or the eval folder holding it), read through the schema; one line where it cannot be."""
    path = Path(path)
    path = path / "report.json" if path.is_dir() else path
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"eval report {path} does not exist (run `dflash-train eval` first)") from None
    except (OSError, ValueError) as err:
        raise UserError(f"eval report {path} cannot be read: {err}") from None
    return from_json(raw, str(path))


def is_report(raw: Any) -> bool:
    """Whether parsed JSON is an eval report (of any version): one names its schema; one of major 0 holds a tau and
    the settings."""
    return isinstance(raw, dict) and ("schema_version" in raw or {"tau", "settings"} <= raw.keys())


def from_json(raw: Any, where: str = "the eval report") -> EvalReport:
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a JSON object, found {type(raw).__name__}")
    version = str(raw.get("schema_version", "0.0"))
    major = version.split(".")[0]
    if major == "0":
        raw = _migrate_v0(raw)
    elif major != MAJOR:
        raise UserError(f"{where}: eval report schema version {version}, and this dflash-train reads major version "
                        f"{MAJOR}: upgrade dflash-train, or evaluate again")
    try:  # read, it is a report of this schema (a newer minor's fields left out)
        return _decode(EvalReport, {**raw, "schema_version": SCHEMA_VERSION})
    except (TypeError, ValueError, AttributeError) as err:
        raise UserError(f"{where}: not an eval report of schema {version}: {err}") from None


def _migrate_v0(raw: ReportJson) -> ReportJson:
    """Major 0 (reports written before schema_version) -> 1: `tau`/`tau_interval` were the per-prompt mean, now
    tau_per_prompt; the project's loop's figures sat at the top level (and in engines.own), now in `own` where it ran
    (it had methods); engines.vllm is `vllm`; settings held the eval's flags flat, now in settings.options; the
    sweep's first K named its estimate `from`, now `source`; reports before ngram_sweep had prompt lookup's one K in
    `ngram` alone."""
    def renamed(d: Any) -> Any:
        if not isinstance(d, dict):
            return d
        out = {k: v for k, v in d.items() if k not in ("tau", "tau_interval")}
        out.setdefault("tau_per_prompt", d.get("tau"))
        out.setdefault("tau_per_prompt_interval", d.get("tau_interval"))
        return out

    out = {k: raw.get(k) for k in ("block_size", "drafter", "baseline_drafters", "target", "held_out_check")
           if k in raw}
    own_keys = {f.name for f in fields(OwnLoop)}
    methods = raw.get("methods") or []
    if methods or (raw.get("engines") or {}).get("own"):
        own = renamed({k: v for k, v in raw.items() if k in own_keys | {"tau", "tau_interval"}})
        own["methods"] = [renamed(m) for m in methods]
        out["own"] = own
    vllm = (raw.get("engines") or {}).get("vllm")
    if isinstance(vllm, dict):
        vllm = renamed(vllm)
        for key in ("sweep", "ngram_sweep", "suffix_sweep", "ranking"):
            vllm[key] = [renamed(r) for r in vllm.get(key) or []]
        for key in ("ngram", "suffix", "combined"):
            vllm[key] = renamed(vllm.get(key))
        if "ngram_sweep" not in raw["engines"]["vllm"] and vllm.get("ngram"):
            vllm["ngram_sweep"] = [vllm["ngram"]]
        first = (vllm.get("timing") or {}).get("first_k")
        if isinstance(first, dict) and "from" in first:
            vllm["timing"] = {**vllm["timing"], "first_k": {**first, "source": first["from"]}}
        out["vllm"] = vllm
    out["offline"] = renamed(raw.get("offline"))
    settings = raw.get("settings") or {}
    found = {f.name for f in fields(Settings)} - {"options", "template_kwargs"}
    out["settings"] = {**{k: v for k, v in settings.items() if k in found},
                       "template_kwargs": settings.get("template_kwargs") or {},
                       "options": {k: v for k, v in settings.items() if k not in found}}
    return out


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {name: t for name, t in typing.get_type_hints(cls).items() if name in names}


def _decode(tp: Any, value: Any) -> Any:
    """`value` (parsed JSON) as type `tp`: dataclasses from objects (unknown keys ignored, missing ones their
    default), lists and dicts element by element, the rest as it is."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [t for t in typing.get_args(tp) if t is not type(None)]
        return _decode(options[0], value) if len(options) == 1 else value
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{tp.__name__}: expected an object, found {type(value).__name__}")
        hints = _hints(tp)
        return tp(**{k: _decode(hints[k], v) for k, v in value.items() if k in hints})
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_decode(item, v) for v in value]
    if origin is dict:
        _, item = typing.get_args(tp)
        return {k: _decode(item, v) for k, v in value.items()}
    return value


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x
