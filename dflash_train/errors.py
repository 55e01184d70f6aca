"""The one exception type for bad input: the CLI prints its message (which names the file, key or id) and
exits 2 without a stack trace. Bugs stay ordinary exceptions so that they keep their traceback.

Also the two places where a failure that is not a bug is recognised: a write that failed because of the disk or the
folder (`write_failure`), and a check that rank 0 makes for every process of a run (`decided_by_rank0`)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator


class UserError(Exception):
    # True on a rank that only repeats the error rank 0 found (decided_by_rank0): the CLI prints it once
    from_rank0: bool = False


def in_brief(err: BaseException, limit: int = 200) -> str:
    """A library's exception for a one-line message: its type and the first line of its text, cut at `limit`
    characters with "..." where it was cut."""
    text = (str(err).strip().splitlines() or [""])[0]
    text = text if len(text) <= limit else text[:limit].rstrip() + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class CommandParser(argparse.ArgumentParser):
    """argparse with a bad argument (unknown, missing, not a number, not a choice) in one line and exit 2, as a
    UserError is: no usage block above it (`--help` shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


WRITE_ERRNOS = {
    errno.ENOSPC: "disk full (no space left on device)",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file too large (over the size limit of this process, ulimit -f)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
}
# Libraries that write in native code report the OS error in their message: Rust's io::Error as "... (os error 28)"
# or, debug-printed (safetensors), "Os { code: 28, ... }"; torch's checkpoint writer (C++ streams) without the errno.
_OS_ERROR_IN_MESSAGE = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)|\[Errno (\d+)\]")
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)  # a write failed, whatever the file was
_NATIVE_WRITE_FAILED = ("basic_ios::clear", "file write failed", "PytorchStreamWriter failed", "inline_container.cc")
LOW_SPACE_BYTES = 64 << 20


def write_failure(err: BaseException, path: str | Path | None = None, permission: bool = True) -> str | None:
    """Why a write failed, in words, when the disk or the folder is the cause (full, quota, read-only, and with
    `permission` not permitted); None for anything else (a bug keeps its traceback). `path` lets a native writer's
    errno-less failure be told apart: it is called a full disk when the disk under `path` has less than 64 MiB
    left."""
    code = err.errno if isinstance(err, OSError) else None
    if code is None:
        found = _OS_ERROR_IN_MESSAGE.search(str(err))
        code = int(next(g for g in found.groups() if g)) if found else None
    if code in WRITE_ERRNOS and (permission or code in DISK_ERRNOS):
        return WRITE_ERRNOS[code]
    if isinstance(err, OSError) and str(err).startswith("Not enough disk space"):  # datasets' own check before writing
        return WRITE_ERRNOS[errno.ENOSPC]
    if isinstance(err, RuntimeError) and any(marker in str(e) for e in _chain(err) for marker in _NATIVE_WRITE_FAILED):
        free = free_bytes(path) if path is not None else None
        if free is not None and free < LOW_SPACE_BYTES:
            return f"disk full ({free >> 20} MiB left)"
        return f"the write failed ({str(err).splitlines()[0][:200]})"
    return None


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from or while handling (torch's zip writer, failing to finish a file
    after a failed write, raises its own error about the file's end from the original one)."""
    found: list[BaseException] = []
    while err is not None and err not in found:
        found.append(err)
        err = err.__cause__ or err.__context__
    return found


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the file system that holds `path` (or its nearest existing parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def write_error(err: BaseException, path: str | Path, advice: str = "", permission: bool = True) -> UserError | None:
    """A UserError naming `path` and the cause if `err` is a write failure (see `write_failure`), else None."""
    reason = write_failure(err, path, permission)
    if reason is None:
        return None
    return UserError(f"cannot write {path}: {reason}" + (f". {advice}" if advice else ""))


# what a stage's output folder is left as when a write into it fails (provenance.start_output marked it)
RERUN_ADVICE = "The folder stays marked INCOMPLETE; free space and rerun the same command"


@contextlib.contextmanager
def writing(path: str | Path, advice: str = RERUN_ADVICE) -> Iterator[None]:
    """Around a stage's writes into `path`: a write that fails because the disk is full (or a quota or size limit
    is hit) or the file system is read-only becomes one line naming `path` (a Python file object's write error does
    not name its file), with `advice`. Other errors pass unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:  # OSError, or a native writer's own (safetensors' SafetensorError, torch's RuntimeError)
        user = write_error(err, path, advice, permission=False)
        if user is None:
            raise
        raise user from None


def os_error_line(err: OSError) -> UserError | None:
    """The last net of the CLI: an OSError no stage caught, when the disk, the file system or a permission caused it
    (one line naming the file), else None (a bug keeps its traceback)."""
    reason = WRITE_ERRNOS.get(err.errno)
    if reason is None:
        return None
    verb = "cannot write" if err.errno in DISK_ERRNOS else "cannot access"
    return UserError(f"{verb} {err.filename or 'a file'}: {reason}")


def decided_by_rank0(check: Callable[[], Any], rank: int, world: int) -> Any:
    """Run `check` on rank 0 while the other ranks wait; a UserError there is raised on every rank, so that all of
    them stop with its one line instead of waiting forever at the next barrier. Returns what `check` returned on
    rank 0 (None on the other ranks). Single process: just `check()`."""
    if world == 1:
        return check()
    import torch.distributed as dist

    result, box = None, [None]
    if rank == 0:
        try:
            result = check()
        except UserError as err:
            box = [str(err)]
            dist.broadcast_object_list(box, src=0)
            raise
        except BaseException:
            dist.broadcast_object_list(["rank 0 failed (its traceback is in the log)"], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None and rank != 0:
        err = UserError(box[0])
        err.from_rank0 = True
        raise err
    return result


def print_user_error(prefix: str, err: UserError) -> None:
    """The one line of a UserError on stderr; a rank that only repeats rank 0's error stays silent."""
    if err.from_rank0 and os.environ.get("RANK", "0") != "0":
        return
    print(f"{prefix}: error: {err}", file=sys.stderr, flush=True)


INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
# what an interrupted command says when its stage module was not imported yet (it had changed nothing)
NOT_STARTED = "it had not started: nothing was changed"


def run_as_command(prefix: str, run: Callable[[], Any], stage_module: str | None = None) -> int:
    """A stage's entry point: `run()`'s exit code, or 2 after the one line of a UserError (or of an OSError that
    os_error_line recognises) printed under `prefix`; any other exception keeps its traceback.

    Ctrl-C (KeyboardInterrupt) is one line too, and exit 130: "PREFIX: interrupted: " and what the stage kept and
    how to resume, in the words of the INTERRUPTED of the stage's module `stage_module` (NOT_STARTED while that
    module is not imported: `run` may import it)."""
    try:
        return int(run() or 0)
    except KeyboardInterrupt:
        what = getattr(sys.modules.get(stage_module or ""), "INTERRUPTED", NOT_STARTED)
        if os.environ.get("RANK", "0") == "0":  # every process of a run gets the Ctrl-C: rank 0 speaks for them
            print(f"{prefix}: interrupted: {what}", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT
    except UserError as err:
        print_user_error(prefix, err)
        return 2
    except OSError as err:  # a write no stage expected to fail (disk full, read-only folder): say so, exit 2
        user = os_error_line(err)
        if user is None:
            raise
        print_user_error(prefix, user)
        return 2
