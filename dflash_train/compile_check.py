"""Each structured constraint compiled as the engine will compile it, bounded in time: ingest's check that a kept
request is one vLLM takes.

vLLM compiles a request's grammar with xgrammar, for the target's tokenizer, when the request reaches the engine: a
constraint xgrammar cannot read (a regex lookahead, an EBNF syntax error) is refused there, and one whose compile is
slow holds up every request of the batch (a 20,000-string choice compiles for about 20 s here, a 50,000-string one
for minutes). `CompileCheck.problem` compiles a request's constraint exactly so (`constraints.compiled_grammar`, vLLM's
xgrammar backend's calls with the target's tokenizer info) in a child process, `python -m dflash_train.compile_check
TARGET`, which loads the target's tokenizer once and compiles one constraint per line it reads; a compile that takes
over COMPILE_SECONDS is stopped (the child is killed, a new one started for the next) and is the request's problem.
Each distinct constraint (kind and text) is compiled once: a log whose every request carries the same schema costs
one compile. The size limits a constraint must keep before any compile are `constraints`' (MAX_CHOICES,
MAX_SPEC_CHARS).

Only xgrammar is tried: vLLM's `auto` backend may fall back to llguidance for what xgrammar refuses, but the
project's own decoding loops read constraints with xgrammar alone (`constraints.Rules`).
"""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING

from dflash_train.errors import UserError

if TYPE_CHECKING:
    from dflash_train.constraints import Constraints

# the same bound vLLM puts on a regex's compile (VLLM_REGEX_COMPILATION_TIMEOUT_S, default 5), here on every kind
COMPILE_SECONDS = 5.0
START_SECONDS = 300.0  # the child's start: importing transformers and xgrammar, loading the tokenizer
READY = "ready"


class CompileCheck:
    """Compiles the structured constraint of each request for `target` (a name or folder) in a child process,
    started at the first one or by `start`; use as a context manager, or call `close`."""

    def __init__(self, target: str, seconds: float = COMPILE_SECONDS):
        self.target, self.seconds = target, seconds
        self.verdicts: dict[tuple[str, str], str | None] = {}  # (kind, spec as JSON) -> problem or None
        self.proc: subprocess.Popen | None = None
        self.ready = False  # the child has loaded the tokenizer
        self.stderr = None

    def __enter__(self) -> CompileCheck:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def problem(self, constraints: Constraints | None) -> str | None:
        """Why the request's structured constraint does not compile as the engine compiles it, or None (also
        for a request without one)."""
        structured = (constraints or {}).get("structured")
        if structured is None:
            return None
        key = (structured["kind"], json.dumps(structured["spec"], sort_keys=True, ensure_ascii=False))
        if key not in self.verdicts:
            self.verdicts[key] = self._compile(*key)
        return self.verdicts[key]

    def _compile(self, kind: str, spec_json: str) -> str | None:
        proc = self._started()
        proc.stdin.write((json.dumps([kind, spec_json]) + "\n").encode())
        proc.stdin.flush()
        line = _read_line(proc, self.seconds)
        if line is None:
            self.close()
            return (f"its {kind} takes over {self.seconds:g} s to compile (xgrammar, as vLLM compiles it for each "
                    f"request)")
        if not line:
            return f"its {kind} stopped the grammar compiler (xgrammar exited with {self.close()})"
        error = json.loads(line)
        return None if error is None else f"its {kind} does not compile (xgrammar, as vLLM): {error}"

    def start(self) -> None:
        """Start the child without waiting for it (it loads while the caller does other work)."""
        if self.proc is None:
            self.stderr = tempfile.TemporaryFile()
            self.proc = subprocess.Popen([sys.executable, "-m", "dflash_train.compile_check", self.target],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)
            self.ready = False

    def _started(self) -> subprocess.Popen:
        self.start()
        if self.ready:
            return self.proc
        if _read_line(self.proc, START_SECONDS) != json.dumps(READY):
            self.stderr.seek(0)
            lines = self.stderr.read().decode(errors="replace").strip().splitlines()
            self.close()
            raise UserError(f"the grammar compiler (xgrammar) did not start for target {self.target}: "
                            f"{lines[-1] if lines else 'no message'}")
        self.ready = True
        return self.proc

    def close(self) -> int | None:
        """Stop the child (if any); its exit code."""
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            proc.kill()
            code = proc.wait()
            proc.stdin.close()
            proc.stdout.close()
        if self.stderr is not None:
            self.stderr.close()
            self.stderr = None
        return code


def _read_line(proc: subprocess.Popen, seconds: float) -> str | None:
    """The child's next line without its newline ('' when it exited), or None when none came within `seconds`."""
    ready, _, _ = select.select([proc.stdout], [], [], seconds)
    return proc.stdout.readline().decode().rstrip("\n") if ready else None


def _error_text(err: Exception) -> str:
    """xgrammar's message without its time stamp and source location ('[06:02:59] /project/cpp/x.cc:83: ')."""
    lines = str(err).strip().splitlines() or [type(err).__name__]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0])


def _serve(target: str) -> None:
    """The child: one JSON line [kind, spec as JSON] in, one out: null (it compiled) or xgrammar's error."""
    from dflash_train import constraints
    from dflash_train.target import load_tokenizer, vocab_size

    tokenizer, size = load_tokenizer(target), vocab_size(target)
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but the answers on the parent's pipe
    out.write(json.dumps(READY) + "\n")
    out.flush()
    for line in sys.stdin:
        kind, spec_json = json.loads(line)
        try:
            constraints.compiled_grammar.__wrapped__(tokenizer, size, kind, spec_json)  # not kept: compiled once
            error = None
        except Exception as err:  # xgrammar raises RuntimeError, or ValueError/TypeError from its bindings
            error = _error_text(err)
        out.write(json.dumps(error) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
