"""What a logged request asked of its answer besides temperature, top_p and max_tokens: the one place that reads it
from a log, checks it, hands it to vLLM and applies it in the project's own decoding loops.

A request's constraints are one JSON object (`Constraints`), absent (null) for a request that set none, with these keys:

    structured         {"kind", "spec"}: the answer must match a grammar (vLLM's structured outputs)
                         json_schema  spec = the JSON Schema      response_format {"type": "json_schema",
                                                                  "json_schema": {"schema", ...}}, or a forced tool
                                                                  call (see below), or vLLM's `json` / `guided_json`
                         json_object  spec = null                 response_format {"type": "json_object"}
                         regex        spec = the pattern          vLLM's `regex` / `guided_regex`
                         choice       spec = the list of strings  vLLM's `choice` / `guided_choice`
                         grammar      spec = EBNF or Lark text    vLLM's `grammar` / `guided_grammar`
    stop               strings that end the answer (the token completing one is the last kept, as vLLM keeps it)
    stop_token_ids     token ids that end the answer, besides the target's own stop tokens
    seed               the request's sampling seed
    presence_penalty, frequency_penalty   on the answer's tokens (OpenAI)
    repetition_penalty on the prompt's and the answer's tokens (vLLM)
    min_p              (vLLM)
    logit_bias         {token id: bias} (OpenAI)
    n                  answers asked for, 1..128 (OpenAI); one answer is replayed per request

The ranges of the numbers among them are `sampling`'s (the one place that states every decoding setting's range).

Settings left at the API's default (no stop, penalties 0, repetition 1, min_p 0, no bias, n 1) are not recorded,
so a request that set nothing has no constraints. vLLM's extras are read from the request body or from its
`extra_body`, under their current name (`structured_outputs`) or their older `guided_*` names. A forced tool call
(`tool_choice` "required", or a named function) is decoded under the JSON Schema vLLM builds for it: a named
function's parameters; for "required", a non-empty list of {name, parameters} objects, one of the tools each
(at most one with `parallel_tool_calls: false`). `tool_choice` "auto" or "none" constrains nothing.

Anything the API would refuse (a schema that is not a JSON Schema, a regex that does not compile, a stop that is not
a string or list of strings, a penalty or n out of range, two structured constraints at once, a forced tool that is
not among the tools) raises ValueError naming the key: ingest counts such a record as `bad_constraint`. So does a
schema this project will not take: one with a `$ref` to anything but a part of itself (a remote `$ref`: no schema is
ever fetched) or one nested deeper than MAX_SCHEMA_DEPTH; and a structured constraint over the sizes its compile
is bounded by (MAX_CHOICES strings, MAX_SPEC_CHARS characters). Whether it compiles is checked where the target's
tokenizer is at hand: `compile_check`.

In vLLM, `sampling_kwargs` gives the `SamplingParams` arguments. In the project's loops, `Rules` applies the same
settings to the target's logits in vLLM's order (logit bias, penalties, then the grammar's mask) and ends the answer
where vLLM would; the grammar is compiled by xgrammar, the library vLLM decodes structured outputs with, exactly as
vLLM's xgrammar backend compiles it.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, TypedDict

import torch

from dflash_train import sampling
from dflash_train.sampling import RequestBody

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# vLLM's structured-output fields -> our kinds (the request's `structured_outputs` object, or `guided_<field>`)
VLLM_FIELDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex", "choice": "choice",
               "grammar": "grammar"}
SETTING_DEFAULTS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}
NOT_WITH_SPECULATION = ("min_p", "logit_bias")  # vLLM 0.32 refuses these with speculative decoding
MAX_N = 128
# JSON nesting levels (objects and arrays) of a schema: jsonschema's own checks recurse per level and exhaust
# Python's recursion limit (1000 frames) from about 100 levels (check_schema: 99 nested `properties`, 123 nested
# `items`); 64 leaves room for the caller's stack and is deeper than any schema an API request carries. (xgrammar
# compiles deeper schemas: its own limit is on the parser's recursion, 10000.)
MAX_SCHEMA_DEPTH = 64
REF_KEYS = ("$ref", "$dynamicRef")  # a reference to another schema; "#..." is a part of the schema itself
# The sizes a structured constraint is taken up to (`compile_check` then bounds its compile in time). A choice
# compiles to an alternation whose compile grows steeply with its strings (xgrammar, SmolLM2's tokenizer: 5,000
# take 0.05 s, 10,000 2 s, 20,000 21 s, 50,000 over 3 minutes); a regex, grammar, schema (as JSON) or the choices
# together of more characters than MAX_SPEC_CHARS is larger than any an API request needs.
MAX_CHOICES = 5_000
MAX_SPEC_CHARS = 100_000

JsonSchema = dict[str, Any]
"""A JSON Schema as a request carries it (response_format, vLLM's `json`, a tool's parameters): the user's own
document, open; `_schema` checks it."""


class Structured(TypedDict):
    """The structured constraint: its kind (STRUCTURED_KINDS) and spec (the table above: a JsonSchema, None, the
    pattern, the list of strings or the grammar text)."""
    kind: str
    spec: Any


class Constraints(TypedDict, total=False):
    """A request's constraints, the keys of the table above; a key is present only where the request set it."""
    structured: Structured
    stop: list[str]
    stop_token_ids: list[int]
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: dict[str, float]  # token id (as JSON keys are: text) -> bias
    n: int


class StructuredOutputs(TypedDict, total=False):
    """vLLM's `StructuredOutputsParams` fields (VLLM_FIELDS): one of them, set."""
    json: JsonSchema
    json_object: bool
    regex: str
    choice: list[str]
    grammar: str


class SamplingKwargs(TypedDict, total=False):
    """The `vllm.SamplingParams` keyword arguments of a request's constraints (`sampling_kwargs`)."""
    stop: list[str]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_p: float
    logit_bias: dict[int, float]
    structured_outputs: StructuredOutputs


# ------------------------------------------------------------------------------------------------ reading a log

def from_request(request: RequestBody) -> Constraints | None:
    """The constraints of one logged request (the chat-completions body), canonical, or None; ValueError naming
    the key that is not valid."""
    body = {**(request.get("extra_body") if isinstance(request.get("extra_body"), dict) else {}), **request}
    out: Constraints = {}
    structured = _structured(body)
    if structured is not None:
        out["structured"] = structured
    stop = body.get("stop")
    if stop is not None and stop != [] and stop != "":
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not stops or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {_shown(stop)}")
        out["stop"] = stops
    ids = body.get("stop_token_ids")
    if ids:
        if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {_shown(ids)}")
        out["stop_token_ids"] = [int(i) for i in ids]
    if body.get("seed") is not None:
        out["seed"] = sampling.check_seed(body["seed"])
    for key, default in SETTING_DEFAULTS.items():
        if body.get(key) is not None and (value := sampling.check_setting(key, body[key])) != default:
            out[key] = value
    bias = body.get("logit_bias")
    if bias:
        out["logit_bias"] = sampling.check_logit_bias(bias)
    n = body.get("n")
    if n is not None:
        if not _is_int(n) or not 1 <= n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {_shown(n)}")
        if n != 1:
            out["n"] = int(n)
    return out or None


def _structured(body: RequestBody) -> Structured | None:
    found: list[tuple[str, Structured]] = []
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
            if schema is None:
                raise ValueError("response_format json_schema has no json_schema.schema")
            found.append(("response_format", {"kind": "json_schema", "spec": _schema(schema, "response_format")}))
        elif kind == "json_object":
            found.append(("response_format", {"kind": "json_object", "spec": None}))
        elif kind != "text":
            raise ValueError(f"response_format type must be text, json_object or json_schema, got {_shown(kind)}")
    extras = body.get("structured_outputs")
    if extras is not None and not isinstance(extras, dict):
        raise ValueError(f"structured_outputs must be an object, got {_shown(extras)}")
    for name, kind in VLLM_FIELDS.items():
        for key, value in (((f"structured_outputs.{name}", (extras or {}).get(name)),)
                           + ((f"guided_{name}", body.get(f"guided_{name}")),)):
            if value is None or value is False:
                continue
            found.append((key, {"kind": kind, "spec": _spec(kind, value, key)}))
    tool = _forced_tool(body)
    if tool is not None:
        found.append(("tool_choice", tool))
    if len(found) > 1:
        raise ValueError(f"{found[0][0]} and {found[1][0]} both constrain the answer (vLLM takes one)")
    return found[0][1] if found else None


def _spec(kind: str, value: Any, key: str) -> Any:
    if kind == "json_schema":
        return _schema(value, key)
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{key} must be true, got {_shown(value)}")
        return None
    if kind == "regex":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{key} must be a regular expression, got {_shown(value)}")
        _check_size(key, value)
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"{key} does not compile: {err}") from None
        return value
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError(f"{key} must be a non-empty list of strings, got {_shown(value)}")
        if len(value) > MAX_CHOICES:
            raise ValueError(f"{key} has {len(value):,} strings, over the limit of {MAX_CHOICES:,} (its grammar "
                             f"would take minutes to compile)")
        _check_size(key, "".join(value))
        return value
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{key} must be a grammar text, got {_shown(value)}")
    _check_size(key, value)
    return value


def _check_size(key: str, text: str) -> None:
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"{key} is {len(text):,} characters long, over the limit of {MAX_SPEC_CHARS:,}")


def _schema(value: Any, key: str) -> JsonSchema:
    import jsonschema

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{key}'s schema is not JSON") from None
        except RecursionError:
            raise ValueError(f"{key}'s schema is nested more than {MAX_SCHEMA_DEPTH} levels deep") from None
    if not isinstance(value, dict):
        raise ValueError(f"{key}'s schema must be a JSON object, got {_shown(value)}")
    if problem := _schema_problem(value):
        raise ValueError(f"{key}'s schema {problem}")
    _check_size(f"{key}'s schema", json.dumps(value, ensure_ascii=False))
    try:
        jsonschema.validators.validator_for(value).check_schema(value)
    except jsonschema.SchemaError as err:
        where = "/".join(map(str, err.absolute_path)) or "the top"
        raise ValueError(f"{key}'s schema is not a valid JSON Schema at {where}: {err.message[:120]}") from None
    return value


def _schema_problem(schema: JsonSchema) -> str | None:
    """Why a schema is not taken (nested deeper than MAX_SCHEMA_DEPTH, a remote $ref), or None; walked without
    recursion, so that no depth of nesting can exhaust the stack here."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"is nested more than {MAX_SCHEMA_DEPTH} levels deep"
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if key in REF_KEYS and isinstance(item, str) and not item.startswith("#"):
                return f"has a remote $ref (only '#...' refs are resolved, none is fetched): {_shown(item)}"
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
    return None


def _forced_tool(body: RequestBody) -> Structured | None:
    """The JSON Schema vLLM decodes a forced tool call under (`tool_choice` required or a named function)."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return None
    tools = body.get("tools")
    functions = {t["function"]["name"]: t["function"].get("parameters")
                 for t in tools or [] if isinstance(t, dict) and isinstance(t.get("function"), dict)
                 and isinstance(t["function"].get("name"), str)}
    if choice == "required":
        if not functions:
            raise ValueError("tool_choice is 'required' but the request has no tools")
        items = [{"properties": {"name": {"type": "string", "enum": [name]},
                                 "parameters": _parameters(params, name)},
                  "required": ["name", "parameters"]} for name, params in functions.items()]
        schema: JsonSchema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
        if body.get("parallel_tool_calls") is False:
            schema["maxItems"] = 1
        return {"kind": "json_schema", "spec": schema}
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ValueError(f"tool_choice must be auto, none, required or a named function, got {_shown(choice)}")
    if name not in functions:
        raise ValueError(f"tool_choice names the function {name!r}, which is not among the request's tools")
    return {"kind": "json_schema", "spec": _parameters(functions[name], name)}


def _parameters(params: Any, name: str) -> JsonSchema:
    return _schema(params, f"tools[{name}].parameters") if params else {"type": "object", "properties": {}}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ------------------------------------------------------------------------------------------------ the record

def dumps(constraints: Constraints | None) -> str | None:
    """The stored form (the prompt record's `constraints` column): canonical JSON, null for none."""
    return json.dumps(constraints, sort_keys=True, ensure_ascii=False) if constraints else None


def loads(text: str | dict | None) -> Constraints | None:
    if text is None or isinstance(text, dict):
        return text or None
    return json.loads(text) or None


def identity(constraints: Constraints | None) -> str:
    """What of the constraints makes two requests with the same turns two prompts (ingest's dedup key): everything
    that shapes the answer, not the seed or n."""
    shaping = {k: v for k, v in (constraints or {}).items() if k not in ("seed", "n")}
    return json.dumps(shaping, sort_keys=True, ensure_ascii=False) if shaping else ""


def kinds(constraints: Constraints | None) -> list[str]:
    """The report's labels of one request's constraints: the structured kind and each other setting it has."""
    if not constraints:
        return []
    out = [constraints["structured"]["kind"]] if "structured" in constraints else []
    return out + [k for k in constraints if k != "structured"]


def kind(constraints: Constraints | None) -> str:
    """One label per request: its structured kind, else 'settings' (stop, penalties, ...), else 'none'."""
    if not constraints:
        return "none"
    return constraints["structured"]["kind"] if "structured" in constraints else "settings"


def without(constraints: Constraints | None, keys: tuple[str, ...]) -> Constraints | None:
    return {k: v for k, v in (constraints or {}).items() if k not in keys} or None


# ------------------------------------------------------------------------------------------------ vLLM

def sampling_kwargs(constraints: Constraints | None) -> SamplingKwargs:
    """`vllm.SamplingParams` keyword arguments for the constraints (structured outputs as the dict of
    `StructuredOutputsParams` fields, to be built where vLLM is imported)."""
    c = constraints or {}
    out: SamplingKwargs = {k: c[k] for k in ("stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
                                            "min_p") if k in c}
    if "logit_bias" in c:
        out["logit_bias"] = {int(k): v for k, v in c["logit_bias"].items()}
    if "structured" in c:
        kind, spec = c["structured"]["kind"], c["structured"]["spec"]
        field = {v: k for k, v in VLLM_FIELDS.items()}[kind]
        out["structured_outputs"] = {field: True if kind == "json_object" else spec}
    return out


# ------------------------------------------------------------------------------------------------ checking answers

REGEX_CHECK_SECONDS = 1.0  # a regex that backtracks (nested quantifiers) may take exponential time on an answer


def check_answer(constraints: Constraints | None, text: str) -> dict[str, str | None]:
    """What checking an answer that ended by itself against its request's structured constraint found:
    {"problem": None} valid, {"problem": why} not valid, {"unchecked": why} when no check could run (an EBNF or Lark
    grammar, which only the decoder's own matcher reads; a regex that ran out of time; a $ref that would need a
    fetch), and {} without a structured constraint. A regex is read as the grammar backend reads it: `.` matches
    a newline too."""
    structured = (constraints or {}).get("structured")
    if structured is None:
        return {}
    kind, spec = structured["kind"], structured["spec"]
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            return {"problem": f"not JSON ({err.msg} at character {err.pos})"}
        except RecursionError:
            return {"unchecked": "the answer is nested too deep to read"}
        if kind == "json_object":
            return {"problem": None if isinstance(value, dict) else "not a JSON object"}
        return _schema_check(spec, value)
    if kind == "regex":
        import regex

        try:
            matched = regex.fullmatch(spec, text, flags=regex.DOTALL, timeout=REGEX_CHECK_SECONDS)
        except TimeoutError:
            return {"unchecked": f"the regex took over {REGEX_CHECK_SECONDS:g} s on this answer"}
        except regex.error as err:
            return {"unchecked": f"the regex does not compile in Python ({err})"}
        return {"problem": None if matched else "does not match the regex"}
    if kind == "choice":
        return {"problem": None if text in spec else "not one of the choices"}
    return {"unchecked": "a grammar is read only by the decoder's own matcher"}


def _schema_check(spec: JsonSchema, value: Any) -> dict[str, str | None]:
    """`value` against the JSON Schema `spec`, resolving no reference outside it (nothing is fetched)."""
    import jsonschema
    from referencing import Registry
    from referencing.exceptions import Unresolvable

    def never_fetch(uri: str):
        raise LookupError(f"{uri} is outside the schema: no schema is fetched")

    validator = jsonschema.validators.validator_for(spec)(spec, registry=Registry(retrieve=never_fetch))
    try:
        error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    except Unresolvable as err:
        return {"unchecked": f"the schema's $ref {_shown(getattr(err, 'ref', str(err)))} is not resolved here"}
    except RecursionError:
        return {"unchecked": "the schema or the answer is nested too deep to check"}
    return {"problem": None if error is None else f"not valid under the schema: {error.message[:120]}"}


# ------------------------------------------------------------------------------------------------ the own loops

class Rules:
    """One request's constraints in the project's decoding loops, applied as vLLM applies them: `process` turns the
    target's logits for the next position into the ones the choice is made from (logit bias, then the repetition,
    frequency and presence penalties over the prompt and the answer so far, then the grammar's mask of the tokens
    that keep the answer valid); `accept` records a chosen token and says whether the answer ends with it (a stop
    string completed: the target's stop tokens end it in the loop itself). Call them in token order: the grammar
    follows the accepted tokens."""

    def __init__(self, constraints: Constraints | None, tokenizer, vocab_size: int, stop_ids: list[int],
                 prompt_ids: list[int]):
        c = constraints or {}
        self.constraints = c
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop = list(c.get("stop") or [])
        self.output: list[int] = []
        self.prompt_ids = prompt_ids
        self.bias = {int(k): v for k, v in (c.get("logit_bias") or {}).items() if int(k) < vocab_size}
        self.penalized = any(k in c for k in ("presence_penalty", "frequency_penalty", "repetition_penalty"))
        self.matcher = None
        if "structured" in c:
            self.matcher = _matcher(tokenizer, vocab_size, tuple(stop_ids) + tuple(c.get("stop_token_ids") or ()),
                                    c["structured"]["kind"], json.dumps(c["structured"]["spec"]))
            import xgrammar as xgr

            self._xgr = xgr
            self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    @property
    def active(self) -> bool:
        return bool(self.bias or self.penalized or self.matcher is not None or self.stop)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] logits of the next position -> the ones to choose from (a new tensor)."""
        logits = logits.float().clone()
        for token, value in self.bias.items():
            logits[token] += value
        if self.penalized:
            logits = self._penalize(logits)
        if self.matcher is not None and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(self.bitmask)
            row = logits[None, : self.vocab_size].cpu()
            self._xgr.apply_token_bitmask_inplace(row, self.bitmask)
            logits[: self.vocab_size] = row[0].to(logits.device)
            logits[self.vocab_size:] = float("-inf")
        return logits

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        c, vocab = self.constraints, logits.shape[-1]
        counts = torch.bincount(torch.tensor(self.output, dtype=torch.long), minlength=vocab)[:vocab].to(logits.device)
        seen_out = counts > 0
        rep = c.get("repetition_penalty", 1.0)
        if rep != 1.0:
            seen = seen_out.clone()
            prompt = torch.tensor([t for t in self.prompt_ids if t < vocab], dtype=torch.long, device=logits.device)
            seen[prompt] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - c.get("frequency_penalty", 0.0) * counts.float()
        return logits - c.get("presence_penalty", 0.0) * seen_out.float()

    def accept(self, token: int) -> bool:
        """Record the chosen `token`; True when the answer ends with it (a stop string is complete)."""
        self.output.append(int(token))
        if self.matcher is not None and not self.matcher.is_terminated():
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"token {token} breaks the request's {self.constraints['structured']['kind']} "
                                   f"constraint: it was chosen outside the grammar's mask")
        if self.stop:
            text = self.tokenizer.decode(self.output, skip_special_tokens=True)
            return any(s in text for s in self.stop)
        return False


def check_replayable(constraints: Constraints | None, greedy: bool, where: str) -> None:
    """The project's loops replay every constraint but min_p in sampling (at temperature 0 it changes nothing, as
    in vLLM); ValueError saying so otherwise, and when the grammar library is missing."""
    c = constraints or {}
    if "min_p" in c and not greedy:
        raise ValueError(f"{where}: min_p {c['min_p']} at temperature > 0 is replayed by vLLM only: pass --engine vllm")
    if "structured" in c:
        import importlib.util

        if importlib.util.find_spec("xgrammar") is None:
            raise ValueError(f"{where}: its {c['structured']['kind']} constraint needs xgrammar (installed with vLLM: "
                             f"`make install`), or pass --engine vllm")


def _matcher(tokenizer, vocab_size: int, stop_ids: tuple[int, ...], kind: str, spec_json: str):
    import xgrammar as xgr

    compiled = compiled_grammar(tokenizer, vocab_size, kind, spec_json)
    return xgr.GrammarMatcher(compiled, override_stop_tokens=list(dict.fromkeys(stop_ids)) or None)


@functools.lru_cache(maxsize=64)
def compiled_grammar(tokenizer, vocab_size: int, kind: str, spec_json: str):
    """The compiled grammar of one constraint, as vLLM's xgrammar backend compiles it (any whitespace in JSON;
    a choice as an EBNF alternation of its strings; a grammar without '::=' read as Lark)."""
    compiler = _compiler(tokenizer, vocab_size)
    spec = json.loads(spec_json)
    if kind == "json_schema":
        return compiler.compile_json_schema(json.dumps(spec), any_whitespace=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(spec))
    if any("::=" in re.sub(r"(#|//).*$", "", line) for line in spec.split("\n")):
        return compiler.compile_grammar(spec)
    return compiler.compile_lark(spec)


@functools.lru_cache(maxsize=4)
def _compiler(tokenizer, vocab_size: int):
    import xgrammar as xgr

    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))


def choice_grammar(choices: list[str]) -> str:
    """A choice constraint as the EBNF grammar vLLM builds for it: the strings as alternatives, escaped."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}

    def escape(ch: str) -> str:
        if ch in escapes:
            return escapes[ch]
        return f"\\u{ord(ch):04x}" if ord(ch) < 0x20 or ord(ch) == 0x7F else ch

    return "root ::= " + " | ".join('"' + "".join(map(escape, c)) + '"' for c in choices)
