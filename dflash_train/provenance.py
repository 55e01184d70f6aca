"""What made an output folder: written next to every store, checkpoint, eval report and pushed folder.

Also the completeness marker every stage uses: a folder is started (marked incomplete), filled, then
completed; a rerun sees the marker and finishes or redoes the work instead of trusting a half-written folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, TypedDict

PROVENANCE_FILE = "provenance.json"
INCOMPLETE_MARKER = "INCOMPLETE"
_PACKAGES = ("dflash-train", "torch", "transformers", "datasets", "accelerate", "deepspeed", "safetensors",
             "huggingface_hub", "gguf", "numpy")

StageConfig = dict[str, Any]
"""What a stage ran with, as its records keep it (provenance.json's `config`, the ingest report's `config`, the eval
report's settings.options, training_args.json's `recipe`): `dataclasses.asdict` of the stage's config (the train
stage's: its recipe, by section; capture's: its store's settings). Its keys are that stage's own."""


class GitCommit(TypedDict):
    commit: str | None  # None: not run from a git checkout
    dirty: bool | None  # uncommitted changes to tracked files


class Provenance(TypedDict, total=False):
    """provenance.json (`provenance`): these keys, then the stage's own (`extra`: stage, run, drafter, ...)."""
    created: str
    command: list[str]
    cwd: str
    git: GitCommit
    packages: dict[str, str | None]  # version of each of _PACKAGES, None: not installed
    python: str
    host: str
    config: StageConfig
    stage: str


def git_commit(repo_dir: str | Path | None = None) -> GitCommit:
    """The commit of the checkout dflash_train runs from, and whether it has uncommitted changes."""
    cwd = Path(repo_dir) if repo_dir else Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
        return {"commit": commit, "dirty": dirty}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------- digests this machine knows

DIGEST_CACHE = "file-sha256.json"  # in the user cache (cache_dir): {"path:size:mtime_ns:inode": sha256}


def cache_dir() -> Path:
    """The project's per-machine cache (file digests, converted targets): DFLASH_TRAIN_CACHE, else
    ~/.cache/dflash_train."""
    return Path(os.environ.get("DFLASH_TRAIN_CACHE", Path.home() / ".cache" / "dflash_train"))


def _digest_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def _digest_cache() -> Path:
    return cache_dir() / DIGEST_CACHE


def _read_digests() -> dict[str, str]:
    try:
        cache = json.loads(_digest_cache().read_text())
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        return {}


def known_sha256(paths: list[Path]) -> dict[Path, str]:
    """The sha256 this machine computed for each of `paths` as it is now (same size, modification time and inode),
    for those it has one: what lets a large file (a store's shard, a target's weights) be hashed once per machine."""
    cache = _read_digests()
    known = {path: cache.get(_digest_key(path)) for path in map(Path, paths)}
    return {path: digest for path, digest in known.items() if digest}


def remember_sha256(digests: dict[Path, str]) -> None:
    """Record {file: its sha256} for `known_sha256`; best effort (a cache that cannot be written, or an entry a
    concurrent writer overwrote, only means hashing again next time)."""
    cache_file = _digest_cache()
    try:
        merged = {**_read_digests(), **{_digest_key(Path(f)): d for f, d in digests.items()}}
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(merged, indent=0))
        os.replace(tmp, cache_file)
    except OSError:
        pass


def file_sha256(path: str | Path) -> str:
    """sha256 of a file, computed once per machine: a Hugging Face Hub snapshot names it already (the blob its
    symlink points to is named by the sha256 of its contents), and any other file's digest is remembered
    (known_sha256: by path, size, modification time and inode)."""
    path = Path(path)
    blob = path.resolve()
    if path.is_symlink() and len(blob.name) == 64 and all(c in "0123456789abcdef" for c in blob.name):
        return blob.name  # a Hub cache blob: its name is the sha256 of its contents
    if known := known_sha256([blob]).get(blob):
        return known
    size = blob.stat().st_size
    if size > 1 << 30:
        print(f"hashing {blob} ({size / 2**30:.1f} GiB; once per machine)", flush=True)
    value = sha256_file(blob)
    remember_sha256({blob: value})
    return value


def files_sha256(files: list[Path]) -> str:
    """One sha256 over several files, in the order given: each file's name and own sha256 (file_sha256)."""
    return hashlib.sha256("".join(f"{f.name}:{file_sha256(f)}\n" for f in files).encode()).hexdigest()


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance(config: StageConfig | None = None, **extra: Any) -> Provenance:
    record: Provenance = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "cwd": os.getcwd(),
        "git": git_commit(),
        "packages": package_versions(),
        "python": platform.python_version(),
        "host": platform.node(),
    }
    if config is not None:
        record["config"] = config
    record.update(extra)
    return record


def write_provenance(out_dir: str | Path, config: StageConfig | None = None, **extra: Any) -> Path:
    path = Path(out_dir) / PROVENANCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, provenance(config, **extra))
    return path


def read_json(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON file holding an object, or a UserError naming it and what it should hold."""
    from dflash_train.errors import UserError

    path = Path(path)
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} is missing ({what})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({what}): {err}") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a JSON {type(value).__name__}, not an object ({what})")
    return value


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write JSON to a temporary name, fsync, rename: a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def start_output(out_dir: str | Path, stage: str | None = None) -> Path:
    """Create `out_dir` (or reuse it) and mark it incomplete until `complete_output`; the marker names the stage
    writing it (what `stage_of` reads until provenance.json is written)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / INCOMPLETE_MARKER, {
        "stage": stage, "note": "this folder is being written; rerun the same command to finish it"})
    return out


def complete_output(out_dir: str | Path) -> None:
    marker = Path(out_dir) / INCOMPLETE_MARKER
    if marker.exists():
        marker.unlink()


def is_complete(out_dir: str | Path) -> bool:
    out = Path(out_dir)
    return out.is_dir() and (out / PROVENANCE_FILE).exists() and not (out / INCOMPLETE_MARKER).exists()


# --------------------------------------------------------------------------------------------- output folders

LOCK_FILE = ".dflash-train.lock"  # in every output folder: held (flock, via filelock) while a run writes it


def check_made_by(folder: str | Path, stage: str) -> None:
    """A reader's check of the folder it was given: a UserError when another stage made it (an ingest folder
    passed as a store, a store as prompts); folders that record no stage pass."""
    from dflash_train.errors import UserError

    owner = stage_of(folder)
    if owner not in (None, stage):
        raise UserError(f"{folder} holds the output of `dflash-train {owner}`, not of {stage}: pass a folder "
                        f"`dflash-train {stage} --out` wrote")


def stage_of(out_dir: str | Path) -> str | None:
    """The stage that marked `out_dir` as its own (the INCOMPLETE marker while it writes, provenance.json after),
    or None when neither records one (an empty folder, someone else's, or one written before stages were
    recorded)."""
    out = Path(out_dir)
    for name in (INCOMPLETE_MARKER, PROVENANCE_FILE):
        try:
            record = json.loads((out / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and isinstance(record.get("stage"), str):
            return record["stage"]
    return None


class OutputClaim:
    """One run's right to write an output folder: the folder is the stage's own and locked until `release`.

        claim = OutputClaim("data/store/x", "capture", legacy=lambda out: (out / "manifest.json").exists())

    Refused (a UserError naming the folder; nothing is created or changed) when `out_dir`
      - is a file, or a symbolic link where `allow_symlink` is False (a stage that replaces its folder);
      - holds another stage's output, or files no stage marked (unless `legacy(out)` recognises the stage's own
        output from before stages were recorded);
      - is being written by another run right now (its lock is held: two runs into one folder would mix);
      - cannot be written (read-only file system, permissions, disk full).
    A folder that did not exist is created; `release(failed=True)` removes it again if the run left nothing in it:
    only a folder this claim's own mkdir made, only while its lock is held, and only while empty (os.rmdir), so a
    folder another run created or claimed meanwhile is never removed.
    Several processes of one run: rank 0 claims (errors.decided_by_rank0), the others write under its lock."""

    def __init__(self, out_dir: str | Path, stage: str, legacy: Callable[[Path], bool] | None = None,
                 allow_symlink: bool = True):
        from dflash_train.errors import UserError, write_error

        self.out, self.stage = Path(out_dir), stage
        self._lock = None
        self.created = False  # True only when this claim's own mkdir made the folder
        if self.out.is_symlink() and not allow_symlink:
            raise UserError(f"{self.out} is a symbolic link (to {os.readlink(self.out)}): {stage} replaces its output "
                            f"folder, so pass the folder itself or a new one (nothing was changed)")
        if self.out.exists() and not self.out.is_dir():
            raise UserError(f"{self.out} exists and is not a folder")
        self._check_owner(legacy)
        try:
            try:
                self.out.mkdir(parents=True)
                self.created = True
            except FileExistsError:
                pass
            self._acquire()
            self._check_owner(legacy)  # again under the lock: another stage may have claimed it meanwhile
        except OSError as err:
            self.release(failed=True)
            raise (write_error(err, self.out, "Choose a writable folder") or err) from None
        except BaseException:
            self.release(failed=True)
            raise

    def _check_owner(self, legacy: Callable[[Path], bool] | None) -> None:
        from dflash_train.errors import UserError

        if not self.out.is_dir():
            return
        names = sorted(p.name for p in self.out.iterdir() if p.name != LOCK_FILE)
        if not names:
            return
        owner = stage_of(self.out)
        if owner == self.stage or (owner is None and legacy is not None and legacy(self.out)):
            return
        if owner is not None:
            raise UserError(f"{self.out} holds the output of `dflash-train {owner}`, not of {self.stage}: choose "
                            f"another folder (nothing was changed)")
        raise UserError(f"{self.out} already holds files that {self.stage} did not write ({', '.join(names[:5])}"
                        f"{', ...' if len(names) > 5 else ''}): choose an empty or new folder (nothing was changed)")

    def _acquire(self) -> None:
        from filelock import FileLock, Timeout

        from dflash_train.errors import UserError

        path = self.out / LOCK_FILE
        # the run that held the folder failed and removed it (release) after this one found it: no lock file left
        removed = UserError(f"{self.out} was removed by the run that was writing it while this one started "
                            f"(nothing was changed): rerun the same command")
        lock = FileLock(str(path), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            holder = _lock_holder(path)
            raise UserError(f"{self.out} is being written by another run right now{holder}: two runs into one folder "
                            f"would mix their outputs. Wait for it to finish or choose another folder") from None
        except FileNotFoundError:
            raise removed from None
        self._lock = lock
        if not path.exists():  # locked the file that run removed: the lock guards nothing
            raise removed
        try:  # who holds it, for the message above (best effort: an older filelock may truncate it)
            path.write_text(json.dumps({"stage": self.stage, "pid": os.getpid(), "host": platform.node(),
                                        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                        "command": [Path(sys.argv[0]).name, *sys.argv[1:]]}) + "\n")
        except OSError:
            pass

    def release(self, failed: bool = False) -> None:
        """Unlock; after a failed run, first remove the folder if this claim's mkdir made it and it is empty but for
        this claim's lock file: the lock file only while the lock is held (no other run can have claimed the folder
        then), the folder with os.rmdir, which removes only an empty one (a lock file or anything else that another
        run put there meanwhile keeps it)."""
        try:
            if failed and self.created:
                if self._lock is not None and self.out.is_dir() and [p.name for p in self.out.iterdir()] == [LOCK_FILE]:
                    (self.out / LOCK_FILE).unlink()
                with contextlib.suppress(OSError):
                    self.out.rmdir()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def __enter__(self) -> "OutputClaim":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.release(failed=exc_type is not None)


def _lock_holder(path: Path) -> str:
    try:
        record = json.loads(path.read_text())
        return f" ({record['stage']}, pid {record['pid']} on {record['host']} since {record['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def config_differences(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Every leaf where two JSON-like configurations differ, as (dotted key path, old value, new value); a key
    missing on one side has the value `MISSING` there."""
    if isinstance(old, dict) and isinstance(new, dict):
        found = []
        for key in [*old, *(k for k in new if k not in old)]:
            found += config_differences(old.get(key, MISSING), new.get(key, MISSING), f"{prefix}{key}.")
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in config_differences(a, b, f"{prefix}{i}.")]
    return [] if old == new else [(prefix.rstrip("."), old, new)]


class _Missing:
    def __repr__(self) -> str:
        return "(not set)"


MISSING = _Missing()


def shown_pair(old: Any, new: Any, width: int = 60) -> tuple[str, str]:
    """Two differing values as JSON, each cut to about `width` characters around where they first differ."""
    a, b = (v if isinstance(v, _Missing) else json.dumps(v, default=str) for v in (old, new))
    a, b = str(a), str(b)
    if len(a) <= width and len(b) <= width:
        return a, b
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    start = max(0, first - width // 3)

    def cut(text: str) -> str:
        piece = text[start:start + width]
        return ("..." if start else "") + piece + ("..." if start + width < len(text) else "")

    return cut(a), cut(b)


# An absolute local path: "/" or "~/" at the start of a token (not inside a URL, a relative path, a word such as
# tokens/s or an HTML closing tag such as </details>), up to the next space, quote, bracket or separator.
LOCAL_PATH = re.compile(r"(?<![\w:/.~<-])~?/[^\s`'\"|,;()\[\]{}<>*]+")


def without_local_paths(obj: Any) -> Any:
    """`obj` (a string, or JSON-like data at any depth) with every absolute local path replaced by its last
    component: nothing uploaded names a folder of the machine it was made on (stores, logs, home folders)."""
    if isinstance(obj, str):
        return LOCAL_PATH.sub(lambda m: next((p for p in reversed(m.group(0).split("/")) if p not in ("", "~")), "."),
                              obj)
    if isinstance(obj, dict):
        return {k: without_local_paths(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [without_local_paths(v) for v in obj]
    return obj
