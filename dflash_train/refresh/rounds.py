"""A refresh folder's ledger of rounds (rounds.json): which logs each round read, which of their prompts were new and
which had been ingested by an earlier round (seen), how the new ones were split, which drafter was serving when the
round began and, once known, the round's figures and its release decision.

    ledger = load(refresh_dir)
    rnd = ledger.begin(hash_logs(paths), serving, SplitRule(eval_fraction, seed, scrub))  # recorded, or the next
    ... ingest with --exclude-ids holding ledger.known_ids(rnd) ...
    ledger.record_ingest(rnd, *ingested_ids(prompts_dir))    # saved: the round is in the ledger from here on

A round's identity is the content of its logs: one sha256 over the sorted sha256s of its files' bytes (their names
and folders play no part), so the same logs given again, renamed or moved, are the same round: it is resumed or
found finished, never made twice. Logs that overlap an earlier round's only in part are a new round; their prompts
that an earlier round ingested are its seen ones.

The ledger is the authority on splits across rounds. A prompt is held out or trained on as the round that first
ingested it decided (ingest's hash rule, `prompts.split_hash`, or its one-eval fallback, which may hold out a new
prompt whose hash says train); every later round ingests only the ids no earlier round holds (`ingest
--exclude-ids`), so no prompt's split is decided twice. `record_ingest` refuses a round whose new ids an earlier
round holds, so a prompt that moved would stop the round, not leak a held-out prompt into training. The split rule
(eval fraction, seed, and the PII scrub, which changes the ids) is the first round's; a later round with another is
refused.

Written whole to a temporary file and renamed (`provenance.write_json_atomic`): a killed round leaves the ledger as
it was before or after a change, never half of it. A file that is not such a ledger is one line naming it (a
UserError: exit 2), and it is left as it was. Nothing in it names a folder of this machine: logs are recorded by
name and hash, the serving drafter by its Hub repo and revision or its folder's name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

from dflash_train.errors import UserError
from dflash_train.provenance import file_sha256, write_json_atomic

LEDGER_FILE = "rounds.json"
FORMAT = 1  # bumped when a reader of an older ledger would misread it


@dataclass(frozen=True)
class LogFile:
    """One log of a round: its file name (no folder) and the sha256 and size of its bytes."""
    name: str
    sha256: str
    bytes: int


@dataclass(frozen=True)
class SplitRule:
    """What decides a new prompt's id and split: ingest's --eval-fraction and --seed, and whether PII was scrubbed
    (a scrubbed prompt has another id than the raw one, so seen prompts would be taken for new)."""
    eval_fraction: float
    seed: int | None
    scrub: bool


@dataclass
class Round:
    """One round: its identity (`round_id` of its logs), the logs, the drafter serving when it began (a
    `model.published.SourceRecord`: name, repo, revision, weights' sha256), the ids it ingested as new, by split,
    and those it skipped as seen; its figures and release decision (None until the stages that make them record
    them)."""
    number: int
    id: str
    logs: list[LogFile]
    serving: dict[str, Any]
    train: list[str] = field(default_factory=list)
    eval: list[str] = field(default_factory=list)
    seen: list[str] = field(default_factory=list)
    figures: dict[str, Any] | None = None
    release: dict[str, Any] | None = None

    def new_ids(self) -> set[str]:
        """The ids this round ingested as new (both splits)."""
        return set(self.train) | set(self.eval)

    @property
    def name(self) -> str:
        """The round's folder under the refresh folder: round-001, round-002, ..."""
        return f"round-{self.number:03d}"


def hash_logs(paths: Iterable[str | Path]) -> list[LogFile]:
    """Each log's name, sha256 and size, in the order given. Refused: two logs of the same bytes (their prompts
    would count twice in their weights) or of the same name (the ledger names them)."""
    logs: list[LogFile] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise UserError(f"log file {path} does not exist" if not path.exists() else f"{path} is not a file")
        log = LogFile(path.name, file_sha256(path), path.stat().st_size)
        if twin := next((other for other in logs if other.sha256 == log.sha256), None):
            raise UserError(f"log files {twin.name} and {path} hold the same bytes: give each log once")
        if any(other.name == log.name for other in logs):
            raise UserError(f"two log files are named {log.name} ({path} is the second): the ledger records logs by "
                            f"name, rename one")
        logs.append(log)
    if not logs:
        raise UserError("no log file given: a round is the prompts of its logs")
    return logs


def round_id(logs: Iterable[LogFile]) -> str:
    """A round's identity: sha256 over its logs' sha256s, sorted (the order, names and folders of the files play no
    part)."""
    return hashlib.sha256("".join(f"{h}\n" for h in sorted(log.sha256 for log in logs)).encode()).hexdigest()


@dataclass
class Ledger:
    """A refresh folder's rounds, in order, and the split rule they share (None before the first round). A round
    enters it when its ingest is recorded: a round killed before that leaves no trace here (its number goes to the
    next logs), and every recorded round's ids decide what is new for the rounds after it."""
    path: Path
    split: SplitRule | None = None
    rounds: list[Round] = field(default_factory=list)

    def find(self, rid: str) -> Round | None:
        return next((r for r in self.rounds if r.id == rid), None)

    def begin(self, logs: list[LogFile], serving: dict[str, Any], split: SplitRule) -> Round:
        """The round of these logs: the recorded one (to resume, or finished), else the next one (recorded by
        `record_ingest`). Refused: a split rule other than the ledger's, or a recorded round resumed from another
        serving drafter than the one it began with."""
        if self.split is not None and split != self.split:
            changed = ", ".join(f"{k} {getattr(self.split, k)!r} -> {getattr(split, k)!r}"
                                for k in ("eval_fraction", "seed", "scrub")
                                if getattr(split, k) != getattr(self.split, k))
            raise UserError(f"{self.path}: earlier rounds split their prompts by another rule ({changed}): a "
                            f"prompt's split must not change from one round to the next; use the ledger's")
        rid = round_id(logs)
        if found := self.find(rid):
            if _drafter_key(found.serving) != _drafter_key(serving):
                began, now = _describe(found.serving), _describe(serving)
                raise UserError(f"{self.path}: {found.name} (these logs) began from the serving drafter {began}, not "
                                f"{now}{' (other weights)' if now == began else ''}: resume it with the drafter it "
                                f"began from")
            return found
        self.split = split  # saved with the round's ingest
        return Round(number=len(self.rounds) + 1, id=rid, logs=list(logs), serving=dict(serving))

    def known_ids(self, rnd: Round) -> set[str]:
        """The ids the rounds before `rnd` ingested: what `rnd` skips as seen."""
        return set().union(*(r.new_ids() for r in self.rounds if r.number < rnd.number))

    def split_of(self, prompt_id: str) -> str | None:
        """'train' or 'eval' as the round that ingested `prompt_id` decided, None for a prompt no round holds."""
        for r in self.rounds:
            for split in ("train", "eval"):
                if prompt_id in getattr(r, split):
                    return split
        return None

    def record_ingest(self, rnd: Round, train: Iterable[str], eval: Iterable[str], seen: Iterable[str]) -> None:
        """Record what `rnd`'s ingest found, saved: a new round enters the ledger. Refused (one line, nothing
        recorded): an id in both splits, a new id an earlier round holds (its split was decided there), a seen id
        no earlier round holds, or, for a recorded round, another result than the one recorded (a rerun finds the
        same)."""
        train, eval, seen = sorted(set(train)), sorted(set(eval)), sorted(set(seen))
        where = f"{self.path}: {rnd.name}"
        if both := set(train) & set(eval):
            raise UserError(f"{where}: prompt {min(both)} is in both splits of its ingest")
        known = self.known_ids(rnd)
        if again := known & (set(train) | set(eval)):
            raise UserError(f"{where}: {len(again)} prompt(s) it ingested as new were ingested by an earlier round "
                            f"(first {min(again)}, {self.split_of(min(again))} there): its ingest did not exclude the "
                            f"ids earlier rounds hold")
        if unknown := set(seen) - known:
            raise UserError(f"{where}: {len(unknown)} prompt(s) it skipped as seen were ingested by no earlier round "
                            f"(first {min(unknown)})")
        if self.find(rnd.id) is not None:
            if (rnd.train, rnd.eval, rnd.seen) != (train, eval, seen):
                raise UserError(f"{where}: its ingest found other prompts than recorded before (train "
                                f"{len(rnd.train)} -> {len(train)}, eval {len(rnd.eval)} -> {len(eval)}, seen "
                                f"{len(rnd.seen)} -> {len(seen)}): a round's prompts and splits never change")
            return
        rnd.train, rnd.eval, rnd.seen = train, eval, seen
        self.rounds.append(rnd)
        self.save()

    def record_figure(self, rnd: Round, name: str, value: dict[str, Any]) -> None:
        """Record one of `rnd`'s measurements under `name` (its drift, a comparison with the serving drafter),
        saved. A recorded round only: figures belong to a round whose prompts are known."""
        self._recorded(rnd).figures = {**(rnd.figures or {}), name: value}
        self.save()

    def record_release(self, rnd: Round, release: dict[str, Any]) -> None:
        """Record `rnd`'s release decision (released or kept, why, and where the release went), saved: the round is
        done, and the same logs again find it so."""
        self._recorded(rnd).release = dict(release)
        self.save()

    def _recorded(self, rnd: Round) -> Round:
        if self.find(rnd.id) is not rnd:
            raise ValueError(f"{rnd.name} is not a round of {self.path}: record its ingest first")
        return rnd

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, {"format": FORMAT, "split": asdict(self.split) if self.split else None,
                                      "rounds": [asdict(r) for r in self.rounds]})


def _drafter_key(serving: dict[str, Any]) -> tuple:
    """What identifies a serving drafter: where it came from and, where recorded, its weights' hashes."""
    return tuple(str(serving.get(key)) for key in ("name", "repo", "revision", "weights_sha256"))


def _describe(serving: dict[str, Any]) -> str:
    text = serving.get("repo") or serving.get("name") or "?"
    return text + (f" at revision {serving['revision']}" if serving.get("revision") else "")


def ingested_ids(prompts_dir: str | Path) -> tuple[list[str], list[str], list[str]]:
    """(train, eval, seen) ids of a round's finished ingest folder, made with --exclude-ids: what `record_ingest`
    takes."""
    from dflash_train.prompts import SEEN_IDS_FILE, load_prompts, read_ids  # datasets and torch: when needed

    prompts_dir = Path(prompts_dir)
    train, eval = (list(load_prompts(prompts_dir, split)["id"]) for split in ("train", "eval"))
    if not (prompts_dir / SEEN_IDS_FILE).exists():
        raise UserError(f"{prompts_dir} has no {SEEN_IDS_FILE}: it was ingested without --exclude-ids, so its prompts "
                        f"may include earlier rounds' (delete it and rerun the round)")
    return train, eval, sorted(read_ids(prompts_dir / SEEN_IDS_FILE, "the ids its ingest skipped as seen"))


# --- reading ------------------------------------------------------------------------------------------------------


def load(refresh_dir: str | Path) -> Ledger:
    """The ledger of `refresh_dir` (an empty one where it has none yet). A file that is not a ledger this module
    wrote is one line naming it and what is wrong."""
    path = Path(refresh_dir) / LEDGER_FILE
    if not path.exists():
        return Ledger(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # ValueError: JSON or UTF-8
        raise UserError(f"{path} is not a readable refresh ledger ({type(err).__name__}: "
                        f"{str(err).splitlines()[0] if str(err) else ''}); restore it or start another refresh "
                        f"folder") from None
    try:
        return _ledger(path, raw)
    except _Malformed as err:
        raise UserError(f"{path} is not a refresh ledger: {err} (restore it or start another refresh folder)") \
            from None


class _Malformed(Exception):
    """What is wrong with a ledger, at which key (`load` turns it into a UserError naming the file)."""


def _take(obj: Any, key: str, types: type | tuple[type, ...], where: str, optional: bool = False) -> Any:
    if not isinstance(obj, dict):
        raise _Malformed(f"{where or 'the file'} is a JSON {type(obj).__name__}, not an object")
    name = f"{where}.{key}" if where else key
    if key not in obj:
        raise _Malformed(f"{name} is missing")
    value = obj[key]
    if value is None and optional:
        return None
    if not isinstance(value, types) or isinstance(value, bool) and bool not in _as_tuple(types):
        raise _Malformed(f"{name} is {json.dumps(value)[:60]}, not {_type_names(types)}"
                         + (" or null" if optional else ""))
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _type_names(types: type | tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
             dict: "an object"}
    return " or ".join(names[t] for t in _as_tuple(types))


def _strings(obj: Any, key: str, where: str) -> list[str]:
    value = _take(obj, key, list, where)
    if not all(isinstance(v, str) for v in value):
        raise _Malformed(f"{where}.{key} holds something other than strings")
    return value


def _ledger(path: Path, raw: Any) -> Ledger:
    if _take(raw, "format", int, "") != FORMAT:
        raise _Malformed(f"format {raw['format']} (this version reads format {FORMAT})")
    split_raw = _take(raw, "split", dict, "", optional=True)
    split = None if split_raw is None else SplitRule(
        eval_fraction=_take(split_raw, "eval_fraction", (int, float), "split"),
        seed=_take(split_raw, "seed", int, "split", optional=True), scrub=_take(split_raw, "scrub", bool, "split"))
    rounds = []
    for i, item in enumerate(_take(raw, "rounds", list, "")):
        where = f"rounds[{i}]"
        logs = [LogFile(**{f.name: _take(log, f.name, str if f.name != "bytes" else int, f"{where}.logs[{j}]")
                           for f in fields(LogFile)})
                for j, log in enumerate(_take(item, "logs", list, where))]
        rnd = Round(number=_take(item, "number", int, where), id=_take(item, "id", str, where), logs=logs,
                    serving=_take(item, "serving", dict, where),
                    **{key: _strings(item, key, where) for key in ("train", "eval", "seen")},
                    figures=_take(item, "figures", dict, where, optional=True),
                    release=_take(item, "release", dict, where, optional=True))
        if rnd.number != i + 1:
            raise _Malformed(f"{where}.number is {rnd.number}, not {i + 1}: rounds are numbered in order from 1")
        if not logs or rnd.id != round_id(logs):
            raise _Malformed(f"{where}.id is not the identity of its logs")
        if twin := next((r for r in rounds if r.id == rnd.id), None):
            raise _Malformed(f"{where} has the logs of rounds[{twin.number - 1}]: the same logs make one round")
        rounds.append(rnd)
    if rounds and split is None:
        raise _Malformed("split is null but rounds were recorded")
    return Ledger(path, split, rounds)
