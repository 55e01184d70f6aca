"""The prompt record: what `dflash-train ingest` writes and capture, the eval, the demo and the benchmarks read.

A prompt folder is a `datasets.DatasetDict` {train, eval} saved with `save_to_disk` (`features` is its schema),
plus report.json and provenance.json. Each row is a canonical record: `id` (hash of the normalized prompt and
its constraints, `logs.records.prompt_id`, given when a log is parsed), `messages` (every turn up to and including
the last user turn with text), `sampling` (logged temperature/top_p/max_tokens or nulls), `response` (the logged
assistant reply to that last user turn, or null), `source` (file name), `weight` (how often the prompt occurred),
`tools` (the request's tool definitions, a JSON list, or null) and `constraints` (what else shapes the answer, a
JSON object, or null).

A record is in eval iff `split_hash(id, seed)` is below the folder's eval fraction (ingest's split rule).

Readers take `PromptRecord`s: `load_prompt_records` reads one split of a prompt folder, or a raw log file (parsed
and scrubbed by `dflash_train.logs`, deduplicated here); `check_records` checks their settings against the target
before anything decodes them; `prompt_set` names the set a store or an eval holds.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, TypedDict

from dflash_train import constraints as request_constraints
from dflash_train import sampling
from dflash_train.constraints import Constraints
from dflash_train.errors import UserError, in_brief
from dflash_train.logs.records import PROMPT_ID_HEX, Message, PromptRow, ToolDefinition, iter_records
from dflash_train.provenance import StageConfig, check_made_by, is_complete, read_json
from dflash_train.sampling import LoggedSettings

STAGE = "ingest"  # the stage whose output a prompt folder is (its provenance records it)
SEEN_IDS_FILE = "seen_ids.txt"  # in a folder ingested with --exclude-ids: the excluded ids its logs held
TURN_KEYS = {"tool_calls": None, "tool_call_id": None, "name": None}  # null in a stored turn that lacks them


@dataclass
class PromptRecord:
    id: str
    messages: list[Message]  # without the keys a turn does not have
    weight: int = 1
    sampling: LoggedSettings | None = None
    response: str | None = None
    tools: list[ToolDefinition] | None = None  # the request's tool definitions, rendered by the chat template
    constraints: Constraints | None = None  # what else the request asked of its answer


class SourceReport(TypedDict):
    """One log file in the ingest report (stages/ingest/report.build_report); and a count for each of
    logs.values.SKIP_REASONS."""
    name: str
    path: str
    read: int
    kept: int
    duplicates: int
    seen: int  # records of a prompt an earlier ingest took (--exclude-ids)
    blank_lines: int
    formats: dict[str, int]  # records by shape (logs.records.Parsed.format)
    truncated_at_cut: int
    stopped_at: str | None
    damaged: list[str]
    examples: list[str]  # the first skipped records and why


class IngestReport(TypedDict):
    """An ingest folder's report.json (stages/ingest/report.build_report), which each store made from it keeps;
    and a count for each of logs.values.SKIP_REASONS."""
    read: int
    kept: int
    duplicates: int
    seen: int  # records of a prompt an earlier ingest took (--exclude-ids), not ingested again
    blank_lines: int
    with_tools: int
    constrained: int
    constraints: dict[str, int]  # records by constraint kind (`constraints.kinds`)
    truncated_at_cut: int
    pii: dict[str, int] | None  # replaced, by kind; None: not scrubbed
    formats: dict[str, int]
    train: int
    eval: int
    eval_fallback: str | None  # the record eval holds when none fell under the eval fraction
    seen_prompts: int  # the distinct prompts of the `seen` records (their ids: SEEN_IDS_FILE)
    total_weight: int
    max_weight: int
    stopped_at_max_prompts: bool
    unread_files: list[str]
    sources: list[SourceReport]
    config: StageConfig  # the ingest options (its split rule: eval_fraction, seed)
    wall_s: float


class PromptSet(TypedDict):
    """Which prompts a store holds (`prompt_set`), as its settings record them."""
    source: str  # the ingest folder or raw log, resolved
    split: str | None  # None: a raw log, which has no split
    eval_fraction: float | None
    seed: int | None


# ----------------------------------------------------------------------------------------------------------
# The id, the split and the template inputs


def template_inputs(row: PromptRow) -> tuple[list[Message], list[ToolDefinition] | None]:
    """A stored prompt record as `target.chat_text` takes it: its messages without the keys a turn does not have
    (stored as null: folders written before tool support have no such keys at all) and its tool definitions."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
    tools = row.get("tools")
    return messages, json.loads(tools) if isinstance(tools, str) else tools


def split_hash(record_id: str, seed: int | None = None) -> float:
    """Uniform in [0, 1): the record is in eval iff this is below the eval fraction."""
    key = record_id if seed is None else f"{seed}:{record_id}"
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest(), 16) / 2**256


def read_ids(path: str | Path, what: str) -> set[str]:
    """The prompt ids of an id file, one a line (blank lines ignored): what `write_ids` writes. A line that is not
    a prompt id is one line naming the file and the line."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"{path} does not exist ({what})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path} cannot be read ({what}): {in_brief(err)}") from None
    ids = set()
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text:
            continue
        if len(text) != PROMPT_ID_HEX or text.strip("0123456789abcdef"):
            raise UserError(f"{path} line {n}: {text[:80]!r} is not a prompt id ({PROMPT_ID_HEX} hex digits; "
                            f"{what})")
        ids.add(text)
    return ids


def write_ids(path: str | Path, ids: Iterable[str]) -> None:
    """Prompt ids to a file, sorted, one a line (`read_ids` reads it)."""
    Path(path).write_text("".join(f"{i}\n" for i in sorted(ids)), encoding="utf-8")


# ----------------------------------------------------------------------------------------------------------
# The folder


def features():
    """The schema of a prompt folder's splits (`datasets.Features`)."""
    from datasets import Features, Value

    return Features({
        "id": Value("string"),
        "messages": [{"role": Value("string"), "content": Value("string"),
                      "tool_calls": [{"id": Value("string"), "type": Value("string"),
                                      "function": {"name": Value("string"), "arguments": Value("string")}}],
                      "tool_call_id": Value("string"), "name": Value("string")}],
        "sampling": {"temperature": Value("float64"), "top_p": Value("float64"), "max_tokens": Value("int64")},
        "response": Value("string"),
        "source": Value("string"),
        "weight": Value("int64"),
        "tools": Value("string"),  # the request's tool definitions, a JSON list; null without tools
        "constraints": Value("string"),  # what else shapes the answer, a JSON object (`constraints`); null: none
    })


def load_prompts(prompts_dir: str | Path, split: str = "train"):
    """One split of an ingest output folder, refusing a folder that ingest did not finish."""
    from datasets import load_from_disk

    prompts_dir = Path(prompts_dir)
    check_made_by(prompts_dir, STAGE)
    if not is_complete(prompts_dir):
        raise UserError(f"{prompts_dir} is not a finished ingest output (missing, or marked incomplete): "
                        f"run `dflash-train ingest ... --out {prompts_dir}`")
    if not (prompts_dir / split).is_dir():
        raise UserError(f"{prompts_dir} has no split {split!r}: an ingest output has train and eval")
    try:
        return load_from_disk(str(prompts_dir / split))
    except (OSError, ValueError, IndexError, KeyError) as err:  # a file of the split deleted or cut short
        raise UserError(f"{prompts_dir / split} is damaged ({in_brief(err)}): rerun `dflash-train ingest ... --out "
                        f"{prompts_dir}`") from None


def load_prompt_records(path: str | Path, split: str = "train", limit: int | None = None
                        ) -> tuple[list[PromptRecord], IngestReport | None]:
    """Records of a finished ingest output folder (its `split`) or of one raw log file, and the ingest report.

    A raw log is parsed and scrubbed as ingest reads it (`dflash_train.logs.records.iter_records`) and deduplicated
    here (weight = count); it has no held-out split, so prefer an ingest folder for anything that is evaluated later.
    No record at all is one line: every caller has nothing to do then."""
    path = Path(path)
    if path.is_dir():
        rows, report_path = load_prompts(path, split), path / "report.json"
        report = read_json(report_path, "the ingest report") if report_path.exists() else None
    elif path.exists():
        rows, report = _dedup(iter_records(path)), None
    else:
        raise UserError(f"prompts {path} do not exist (run `dflash-train ingest` first, or pass a log file)")
    records: list[PromptRecord] = []
    seen: set[str] = set()
    for row in rows:
        if limit is not None and len(records) >= limit:
            break
        record = _to_record(row, path)
        if record.id in seen:
            raise UserError(f"{path}: duplicate record id {record.id!r}")
        seen.add(record.id)
        records.append(record)
    if not records:
        counts = (f" (ingest kept {report.get('kept')}: {report.get('train')} train, {report.get('eval')} eval)"
                  if report else "")
        raise UserError(f"no prompts in {path}" + (f", split {split!r}" if path.is_dir() else "") + counts)
    return records, report


def check_records(records: Iterable[PromptRecord], vocab_size: int | None) -> None:
    """Every record's settings and constraints in the ranges ingest reads them with, and the token ids they name in
    the target's vocabulary (`sampling.check_record`): one line naming the first record and key that is not."""
    for record in records:
        try:
            sampling.check_record(record.sampling, record.constraints, vocab_size)
        except ValueError as err:
            raise UserError(f"prompt {record.id}: logged {err}") from None


def _dedup(rows: Iterable[PromptRow]) -> list[PromptRow]:
    by_id: dict[str, PromptRow] = {}
    for row in rows:
        if row["id"] in by_id:
            by_id[row["id"]]["weight"] += row.get("weight") or 1
        else:
            by_id[row["id"]] = dict(row)
    return list(by_id.values())


def _to_record(row: PromptRow, path: Path) -> PromptRecord:
    rid = row.get("id")
    if not isinstance(rid, str) or not rid:
        raise UserError(f"{path}: a record has no string 'id' (keys: {', '.join(row)})")
    raw = row.get("messages")
    if (not isinstance(raw, list) or not raw
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in raw)):
        raise UserError(f"{path}: record {rid!r} has no list of {{role, content}} 'messages'")
    try:
        messages, tools = template_inputs(row)
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: record {rid!r}: 'tools' is not JSON ({err})") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UserError(f"{path}: record {rid!r}: 'tools' is not a list of tool definitions")
    for m in messages:
        if not isinstance(m.get("tool_calls", []), list):
            raise UserError(f"{path}: record {rid!r}: a turn's 'tool_calls' is not a list")
    try:
        constraints = request_constraints.loads(row.get("constraints"))
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: record {rid!r}: 'constraints' is not JSON ({err})") from None
    if constraints is not None and not isinstance(constraints, dict):
        raise UserError(f"{path}: record {rid!r}: 'constraints' is not a JSON object")
    weight = row.get("weight")
    return PromptRecord(id=rid, messages=messages, weight=int(weight) if weight is not None else 1,
                        sampling=row.get("sampling") or None, response=row.get("response"), tools=tools or None,
                        constraints=constraints)


def prompt_set(prompts: str | Path, split: str, ingest_report: IngestReport | None) -> PromptSet:
    """Which prompts a store holds, as its settings record it: the ingest folder (or raw log) they come from, the
    split, and the split rule (eval fraction and seed) that decided it. A store holds one such set: a capture of
    another split or source into it is refused, so that eval prompts never reach a training store."""
    path = Path(prompts)
    rule = (ingest_report or {}).get("config") or {}
    return {"source": str(path.resolve()), "split": split if path.is_dir() else None,
            "eval_fraction": rule.get("eval_fraction"), "seed": rule.get("seed")}
