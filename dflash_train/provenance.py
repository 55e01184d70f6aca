"""What made an output folder: written next to every store, checkpoint, eval report and pushed folder.

Also the completeness marker every stage uses: a folder is started (marked incomplete), filled, then
completed; a rerun sees the marker and finishes or redoes the work instead of trusting a half-written folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

PROVENANCE_FILE = "provenance.json"
INCOMPLETE_MARKER = "INCOMPLETE"
_PACKAGES = ("dflash-train", "torch", "transformers", "datasets", "accelerate", "deepspeed", "safetensors",
             "huggingface_hub", "gguf", "numpy")


def git_commit(repo_dir: str | Path | None = None) -> dict[str, Any]:
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


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def provenance(config: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    record = {
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


def write_provenance(out_dir: str | Path, config: dict[str, Any] | None = None, **extra: Any) -> Path:
    path = Path(out_dir) / PROVENANCE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, provenance(config, **extra))
    return path


def read_json(path: str | Path, what: str) -> Any:
    """A JSON file, or a UserError naming it and what it should hold."""
    from dflash_train.errors import UserError

    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path} is missing ({what})") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({what}): {err}") from None


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


def start_output(out_dir: str | Path) -> Path:
    """Create `out_dir` (or reuse it) and mark it incomplete until `complete_output`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INCOMPLETE_MARKER).write_text("this folder is being written; rerun the same command to finish it\n")
    return out


def complete_output(out_dir: str | Path) -> None:
    marker = Path(out_dir) / INCOMPLETE_MARKER
    if marker.exists():
        marker.unlink()


def is_complete(out_dir: str | Path) -> bool:
    out = Path(out_dir)
    return out.is_dir() and (out / PROVENANCE_FILE).exists() and not (out / INCOMPLETE_MARKER).exists()
