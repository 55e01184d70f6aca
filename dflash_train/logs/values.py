"""A log file's bytes -> its record-level JSON values: JSON lines (plain or gzip), a .json document (an array,
possibly cut off mid-record, or a stream of objects) or Parquet rows; what cannot be decoded comes as `Bad`."""

from __future__ import annotations

import codecs
import gzip
import json
import re
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from dflash_train.errors import UserError

# Why a record was skipped. The BAD_REASONS are defects of the input and count against --max-bad-fraction
# (bad_sampling: a temperature, top_p or max_tokens the API would have refused; bad_constraint: a response format,
# stop, penalty or other setting it would have refused, `constraints.from_request`); too_long and template_error are
# prompts the target cannot serve.
BAD_REASONS = ("malformed", "non_utf8", "unknown_format", "empty", "bad_sampling", "bad_constraint")
SKIP_REASONS = BAD_REASONS + ("too_long", "template_error")
MAX_EXAMPLES = 5  # skipped records quoted per source in the report (every one is in the ingest folder's SKIPPED_FILE)
MAX_DETAIL = 1000  # characters of a skipped record's reason kept in SKIPPED_FILE
SKIPPED_FILE = "skipped.jsonl"
MAX_RECORD_CHARS = 64 << 20  # one JSON value larger than this in a .json document is treated as malformed
CHUNK_BYTES = 1 << 20


# ----------------------------------------------------------------------------------------------------------
# Reading: every record-level JSON value of a file, as (where, value) or (where, Bad)


@dataclass
class Bad:
    reason: str  # one of SKIP_REASONS
    detail: str
    count: int = 1  # records it stands for (an unreadable Parquet row group)


@dataclass
class SourceStats:
    """What happened to one input file's records; sums over sources give the report's totals."""
    name: str
    counts: Counter = field(default_factory=Counter)  # read, kept, duplicates, blank_lines, SKIP_REASONS
    formats: Counter = field(default_factory=Counter)
    pii: Counter = field(default_factory=Counter)
    constraints: Counter = field(default_factory=Counter)  # records by constraint kind (`constraints.kinds`)
    examples: list[str] = field(default_factory=list)  # the first skipped records: "line 3: malformed (...)"
    truncated_at_cut: int = 0  # partial records lost where the file was cut off
    stopped_at: str | None = None  # where reading a .json document or gzip stream had to stop early
    damaged: list[str] = field(default_factory=list)  # unreadable parts that reading went on after
    skipped: IO[str] | None = field(default=None, repr=False)  # every skipped record, a JSON line each

    def skip(self, where: str, reason: str, detail: str, count: int = 1) -> None:
        self.counts[reason] += count
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason} ({detail[:120]})")
        if self.skipped is not None:
            self.skipped.write(json.dumps({"source": self.name, "where": where, "reason": reason,
                                           "detail": detail[:MAX_DETAIL], "records": count}) + "\n")

    def bad(self) -> int:
        return sum(self.counts[r] for r in BAD_REASONS)


def read_values(path: Path, stats: SourceStats,
                progress: Callable[[int], None] | None = None) -> Iterator[tuple[str, Any]]:
    """(where, value) for every record of a log file; values that cannot be decoded come as `Bad`.

    `progress` is called now and then with the number of (compressed) bytes read so far."""
    progress = progress or (lambda _: None)
    with open(path, "rb") as raw:
        head = raw.read(4)
        raw.seek(0)
        if head == b"PAR1" or path.name.lower().endswith(".parquet"):
            yield from _parquet_rows(path, raw, stats, progress)
            return
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if head[:2] == b"\x1f\x8b" else raw
        try:
            first = stream.peek(4096).lstrip(b"\xef\xbb\xbf \t\r\n")[:1]
        except (EOFError, OSError, zlib.error) as err:
            raise UserError(f"{path}: cannot read the file ({err})") from None
        name = path.name.lower()
        if first == b"[":
            yield from _json_document(stream, raw, stats, progress, array=True)
        elif first == b"{" and ".json" in name and ".jsonl" not in name:
            yield from _json_document(stream, raw, stats, progress, array=False)
        else:
            yield from _json_lines(stream, raw, stats, progress)


def _json_lines(stream, raw, stats: SourceStats, progress) -> Iterator[tuple[str, Any]]:
    lineno = 0
    try:
        for lineno, line in enumerate(stream, 1):
            if lineno % 1000 == 0:
                progress(raw.tell())
            if not line.strip():
                stats.counts["blank_lines"] += 1
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as err:
                yield f"line {lineno}", Bad("non_utf8", f"invalid UTF-8 byte at column {err.start + 1}")
                continue
            if lineno == 1:
                text = text.lstrip("\ufeff")
            try:
                yield f"line {lineno}", json.loads(text)
            except json.JSONDecodeError as err:
                yield f"line {lineno}", Bad("malformed", f"{err.msg.removesuffix(' at')} at column {err.colno}")
            except (ValueError, RecursionError) as err:
                yield f"line {lineno}", Bad("malformed", f"{type(err).__name__}: {err}"[:120])
    except (EOFError, OSError, zlib.error) as err:  # a gzip stream cut off or corrupt: keep what was read
        stats.truncated_at_cut += 1
        stats.stopped_at = f"line {lineno + 1}: {err}"
    progress(raw.tell())


# A JSON decode error whose remaining text is empty or a prefix of a literal or number means "the text ends
# here" (a chunk boundary, or the cut at the end of a truncated file); anything else is a real syntax error.
_CUT_TAIL = re.compile(r"-?[0-9.eE+-]*|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?")
_WS = re.compile(r"[ \t\r\n]*")
_DECODER = json.JSONDecoder()


class _TextChunks:
    """A growing window of decoded text over a binary stream; undecodable bytes become lone surrogates
    (surrogateescape), which the record check later counts as non-UTF-8."""

    def __init__(self, stream, raw, progress):
        self.stream, self.raw, self.progress = stream, raw, progress
        self.decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.buf, self.pos, self.offset, self.eof = "", 0, 0, False

    def more(self) -> bool:
        if self.eof:
            return False
        data = self.stream.read(CHUNK_BYTES)
        self.eof = not data
        text = self.decoder.decode(data, final=self.eof)
        if self.offset == 0 and self.pos == 0 and not self.buf:
            text = text.lstrip("\ufeff")
        self.offset += self.pos
        self.buf = self.buf[self.pos:] + text
        self.pos = 0
        self.progress(self.raw.tell())
        return True

    def next_char(self) -> str:
        """Skip whitespace; the next character without consuming it, "" at the end of the file."""
        while True:
            self.pos = _WS.match(self.buf, self.pos).end()
            if self.pos < len(self.buf):
                return self.buf[self.pos]
            if not self.more():
                return ""

    def value(self) -> Any:
        """The JSON value starting at pos, or `_CUT` when the file ends inside it, or a `Bad`."""
        while True:
            try:
                obj, end = _DECODER.raw_decode(self.buf, self.pos)
            except json.JSONDecodeError as err:
                tail = self.buf[err.pos:].strip()
                cut = (err.msg.startswith("Unterminated string") or _CUT_TAIL.fullmatch(tail) is not None
                       or (err.msg.startswith("Invalid \\uXXXX") and len(tail) < 6))
                if not cut:
                    return Bad("malformed", f"{err.msg.removesuffix(' at')} at character {self.offset + err.pos}")
                if len(self.buf) - self.pos > MAX_RECORD_CHARS:
                    return Bad("malformed", f"a value longer than {MAX_RECORD_CHARS} characters "
                                            f"at character {self.offset + self.pos}")
                if not self.more():
                    return _CUT
                continue
            except RecursionError:
                return Bad("malformed", f"nested too deeply at character {self.offset + self.pos}")
            if end == len(self.buf) and not self.eof and self.buf[end - 1] not in "}]\"":
                self.more()  # a number or literal at the end of the window may continue in the next chunk
                continue
            self.pos = end
            return obj

    def skip_value(self, array: bool) -> bool:
        """Move past a malformed value that starts at pos; False when the document ends first.

        The value ends where its brackets close (strings skipped; a string never spans a raw newline, so a lost
        quote stays local) and, in an array, at the next ',' or ']' outside brackets. A value that never closes
        ends where a line starts with the value's own indentation and '{' (the next record of a pretty-printed
        or line-per-record array)."""
        while True:
            end = _value_end(self.buf, self.pos, array, self.eof)
            if end is not None:
                self.pos = end
                return True
            if len(self.buf) - self.pos > MAX_RECORD_CHARS or not self.more():
                self.pos = len(self.buf)
                return False


_CUT = object()


_STRUCTURE = re.compile(r'["\[\]{},\n]')
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_AFTER_STRING = re.compile(r"[ \t\r\n]*")


def _value_end(buf: str, pos: int, array: bool, eof: bool) -> int | None:
    """Where the malformed value at buf[pos] ends (see `_TextChunks.skip_value`); None: read more first.

    Strings are skipped; a quote whose string is not followed by one of : , ] } was not a closing quote (a
    quote is missing or unescaped), so the scan pairs it with the next one instead: brackets inside the text
    after a lost quote are not counted. A bracket where an object expects a key means an object was never
    closed: the value ends at the comma before it."""
    line_start = buf.rfind("\n", 0, pos) + 1
    indent = buf[line_start:pos]
    restart = "\n" + indent + "{" if not indent.strip() else None  # the value is the first thing on its line
    stack: list[str] = []
    expect_key, last_comma, i = False, None, pos
    while True:
        m = _STRUCTURE.search(buf, i)
        if m is None:
            return len(buf) if eof else None
        ch, i = m.group(), m.end()
        if ch == '"':
            s = _STRING.match(buf, m.start())
            if s is None:  # no closing quote before the line ends
                if not eof and "\n" not in buf[i:]:
                    return None
                continue
            after = _AFTER_STRING.match(buf, s.end()).end()
            if after == len(buf) and not eof:
                return None
            i = s.end() if after == len(buf) or buf[after] in ":,]}" else s.end() - 1
            expect_key = False
        elif ch == "\n":
            if restart and stack and buf.startswith(restart, m.start()):
                return i
        elif ch in "{[":
            if stack and expect_key:  # an unclosed object: a new value begins here
                return last_comma if array and last_comma is not None else m.start()
            if not array and not stack and buf[pos:m.start()].strip():
                return m.start()  # garbage between values: the next value starts here
            stack.append(ch)
            expect_key = ch == "{"
        elif ch in "}]":
            if not stack:
                if array and ch == "]":
                    return m.start()
                continue
            stack.pop()
            expect_key = False
            if not stack and not array:
                return i
        else:  # ","
            if not stack and array:
                return m.start()
            last_comma, expect_key = m.start(), stack[-1:] == ["{"]


def _json_document(stream, raw, stats: SourceStats, progress, array: bool) -> Iterator[tuple[str, Any]]:
    """Records of a .json document: the elements of a top-level array, or a sequence of top-level values.

    Streams with raw_decode over chunks, so memory holds one record, not the file. A document cut off at
    the end (as the ShareGPT wheel's file is) stops cleanly and counts the partial record. A syntax error in
    the middle is one malformed record: reading resumes after it (`_TextChunks.skip_value`), so every valid
    record of the document is kept whatever its neighbours hold. A missing comma between two elements is
    forgiven: the element after it is read as the next one."""
    text = _TextChunks(stream, raw, progress)
    index = 0
    if array:
        text.next_char()
        text.pos += 1  # the "["
        if text.next_char() == "]":
            return
    while True:
        ch = text.next_char()
        if ch == "":
            if array:  # the array never closed: the file was cut between two records
                stats.stopped_at = f"element {index + 1}: the file ends before the array is closed"
            return
        index += 1
        where = f"element {index}" if array else f"value {index}"
        value = text.value()
        if value is _CUT:
            stats.truncated_at_cut += 1
            stats.stopped_at = f"{where}: the file ends inside this record (cut off)"
            return
        yield where, value
        if isinstance(value, Bad) and not text.skip_value(array):
            stats.stopped_at = f"{where}: {value.detail}; no record starts after it"
            return
        if array:
            ch = text.next_char()
            if ch == ",":
                text.pos += 1
            elif ch == "]":
                return


def _parquet_rows(path: Path, raw, stats: SourceStats, progress) -> Iterator[tuple[str, Any]]:
    """Rows of a Parquet file, one row group at a time: a row group that cannot be read (a corrupt page, a cut
    file) is counted as that many malformed rows, and reading goes on with the next one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(raw)
    except (pa.ArrowException, OSError) as err:
        raise UserError(f"{path}: not a readable Parquet file ({err})") from None
    row = 0
    for group in range(parquet.num_row_groups):
        size = parquet.metadata.row_group(group).num_rows
        done = 0
        try:
            for batch in parquet.iter_batches(batch_size=1024, row_groups=[group]):
                for value in batch.to_pylist():
                    done += 1
                    yield f"row {row + done}", value
                progress(raw.tell())
        except (pa.ArrowException, OSError) as err:
            lost = size - done
            stats.damaged.append(f"row group {group + 1} of {parquet.num_row_groups} (rows {row + done + 1}-"
                                 f"{row + size}) is unreadable ({err}): {lost} row(s) counted as malformed")
            yield f"rows {row + done + 1}-{row + size}", Bad("malformed", f"unreadable row group {group + 1}: {err}",
                                                             count=lost)
        row += size
