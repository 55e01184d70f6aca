"""One JSON value of a log -> a canonical prompt record (`dflash_train.prompts`): its shape detected
(`parse_record`), cut at the last user or tool turn, PII scrubbed, and given its prompt id (`iter_records`)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypedDict

from dflash_train import constraints as request_constraints
from dflash_train import sampling
from dflash_train.constraints import Constraints
from dflash_train.sampling import LoggedSettings, RequestBody
from dflash_train.errors import UserError
from dflash_train.logs.values import Bad, SourceStats, read_values
from dflash_train.pii import scrub_text


PROMPT_ID_HEX = 32  # hex digits of a prompt id (`prompt_id`): 128 bits


class Skip(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


# ----------------------------------------------------------------------------------------------------------
# The canonical record


class ToolFunction(TypedDict):
    name: str
    arguments: str  # a JSON text, as the API logs it


class ToolCall(TypedDict):
    """An OpenAI tool call of an assistant turn."""
    id: str | None  # the call's own random id, where logged
    type: str  # "function"
    function: ToolFunction


class _Turn(TypedDict):
    role: str  # system | user | assistant | tool (ROLES' values)
    content: str


class Message(_Turn, total=False):
    """One turn of a prompt: {role, content} plus tool_calls / tool_call_id / name where the turn has them (null
    where a prompt folder stores a turn without them)."""
    tool_calls: list[ToolCall] | None
    tool_call_id: str | None  # a tool turn: the call it answers
    name: str | None  # a tool turn: the tool's name


ToolDefinition = dict[str, Any]
"""One of a request's tool definitions, {type: function, function: {name, description, parameters}}, as the API
takes it: passed to the chat template as it is (its parameters are the tool's own JSON Schema)."""


class PromptRow(TypedDict):
    """A canonical prompt record as `iter_records` yields it and a prompt folder stores it (`prompts.features`)."""
    id: str  # `prompt_id`
    messages: list[Message]
    sampling: LoggedSettings
    response: str | None
    source: str  # the log file's name
    weight: int  # how often the prompt occurred
    tools: str | None  # the request's tool definitions, a JSON list of ToolDefinition
    constraints: str | None  # `constraints.dumps`


# ----------------------------------------------------------------------------------------------------------
# Parsing: one JSON value -> messages, sampling, response


@dataclass
class Parsed:
    format: str  # openai_request | messages | sharegpt | prompt
    messages: list[Message]
    sampling: LoggedSettings
    response: str | None
    tools: str | None = None  # the request's tool definitions, a JSON list as logged (legacy `functions` converted)
    constraints: Constraints | None = None  # what else the request asked of its answer


# ShareGPT: human/gpt/system, plus a few replies from other chatbots; OpenAI: system/developer/user/assistant, and
# tool (function in the legacy API) for tool results; LLaMA-Factory's ShareGPT: function_call and observation.
ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "tool": "tool",
         "function": "tool", "observation": "tool", "function_call": "assistant"}
_SURROGATES = re.compile("[\ud800-\udfff]")


def normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def prompt_id(messages: list[Message], tools: str | None = None, constraints: Constraints | None = None) -> str:
    """Stable id of a prompt: sha256 of its turns with whitespace collapsed and case folded (128 bits), plus
    its tool calls (names and arguments, not their random call ids), tool names and tool definitions where it
    has them, and the constraints that shape its answer (`constraints.identity`: one prompt under two schemas is
    two prompts). A prompt of plain turns without constraints has the id it always had."""
    def turn(m: Message) -> str:
        text = m["role"] + "\x1f" + normalize(m["content"])
        calls = [[c["function"]["name"], c["function"]["arguments"]] for c in m.get("tool_calls") or []]
        if calls or m.get("name"):
            text += "\x1f" + json.dumps([calls, m.get("name")], ensure_ascii=False)
        return text

    norm = "\x1e".join(turn(m) for m in messages) + ("\x1d" + tools if tools else "")
    shaping = request_constraints.identity(constraints)
    norm += "\x1c" + shaping if shaping else ""
    return hashlib.sha256(norm.encode("utf-8")).hexdigest()[:PROMPT_ID_HEX]


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


def _turns(raw: Any, role_key: str, content_key: str, where: str) -> list[Message]:
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
        out: Message = {"role": role, "content": "" if content is None and calls else _text(content, here)}
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


def _tool_call(call: Any, where: str) -> ToolCall:
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


def _tools(src: RequestBody, where: str) -> str | None:
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


def _cut_at_last_input(turns: list[Message]) -> tuple[list[Message], str | None]:
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


def _constraints(src: RequestBody, where: str) -> Constraints | None:
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


def _sampling(src: RequestBody) -> LoggedSettings:
    """The logged decoding settings, checked as the API defines them (`dflash_train.sampling`)."""
    try:
        return sampling.logged(src)
    except ValueError as err:
        raise Skip("bad_sampling", str(err)) from None


# ----------------------------------------------------------------------------------------------------------
# Canonical records


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


def _scrub_turn(m: Message, counts: Counter) -> Message:
    out: Message = {**m, "content": scrub_text(m["content"], counts)}
    if m.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _scrub_json(c["function"]["arguments"],
                                                                                          counts)}}
                             for c in m["tool_calls"]]
    return out


def located_records(path: Path, stats: SourceStats, scrub: bool,
                    progress: Callable[[int], None] | None = None) -> Iterator[tuple[str, PromptRow]]:
    """(where, canonical record) for every usable record of a log file; the others are counted in `stats`."""
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


def iter_records(path: str | Path, scrub: bool = True, stats: SourceStats | None = None) -> Iterator[PromptRow]:
    """Canonical records of one raw log file, in file order, neither deduplicated nor token-limited.

    Records that cannot be used are skipped and counted in `stats` (pass one to see them)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"log file {path} does not exist")
    stats = stats if stats is not None else SourceStats(path.name)
    for _, record in located_records(path, stats, scrub):
        yield record
