"""Real full disks and real read-only file systems for tests: a command runs in a private mount namespace (an
unprivileged user namespace, `unshare -Urm`) where a folder is a fresh tmpfs of a few KiB (writes past it fail with
ENOSPC, as on a full disk) or a read-only mount (EROFS). Nothing outside the command sees the mount. Where the kernel
or the container does not allow user namespaces, the test is skipped."""

from __future__ import annotations

import functools
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest


@functools.lru_cache(maxsize=1)
def namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=4k tmpfs /tmp"], capture_output=True)
    return probe.returncode == 0


def run_with_mount(cmd: list[str], mountpoint: Path, size: str = "64k", read_only: bool = False, prepare: str = "",
                   **kwargs) -> subprocess.CompletedProcess:
    """Run `cmd` with `mountpoint` (created here if missing) replaced by an empty tmpfs of `size`; `prepare` (shell)
    runs first inside it (e.g. to create a folder); `read_only` remounts it read-only before `cmd` starts."""
    if not namespaces_work():
        pytest.skip("unprivileged user and mount namespaces (unshare -Urm) are not available here")
    mountpoint.mkdir(parents=True, exist_ok=True)
    m = shlex.quote(str(mountpoint))
    script = f"mount -t tmpfs -o size={size} tmpfs {m} && {prepare or 'true'}"
    if read_only:
        script += f" && mount -o remount,ro {m}"
    script += " && exec " + shlex.join(cmd)
    return subprocess.run(["unshare", "-Urm", "sh", "-c", script], capture_output=True, text=True, **kwargs)
