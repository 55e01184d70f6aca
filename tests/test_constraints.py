import json

import pytest
import torch

from dflash_train import constraints as rc

SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "enum": ["bug", "question"]}},
          "required": ["label"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


# --- reading a request ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("request_, structured", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}}},
     {"kind": "json_schema", "spec": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"kind": "json_object", "spec": None}),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, {"kind": "json_schema", "spec": SCHEMA}),
    ({"guided_json": SCHEMA}, {"kind": "json_schema", "spec": SCHEMA}),
    ({"extra_body": {"guided_regex": "[0-9]{3}"}}, {"kind": "regex", "spec": "[0-9]{3}"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, {"kind": "choice", "spec": ["yes", "no"]}),
    ({"guided_grammar": 'root ::= "a" | "b"'}, {"kind": "grammar", "spec": 'root ::= "a" | "b"'}),
    ({"structured_outputs": {"json_object": True}}, {"kind": "json_object", "spec": None}),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "lookup"}}},
     {"kind": "json_schema", "spec": TOOLS[0]["function"]["parameters"]}),
])
def test_every_way_a_request_asks_for_structured_output_reads_as_one_constraint(request_, structured):
    assert rc.from_request(request_) == {"structured": structured}


def test_a_required_tool_call_is_decoded_under_the_schema_vllm_builds_for_it():
    got = rc.from_request({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    schema = got["structured"]["spec"]
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["lookup"], ["now"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert rc.from_request({"tools": TOOLS, "tool_choice": "auto"}) is None


def test_settings_are_kept_and_those_left_at_the_apis_default_are_not_constraints():
    assert rc.from_request({"stop": [], "presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1,
                            "min_p": 0, "n": 1, "logit_bias": {}, "response_format": {"type": "text"}}) is None
    got = rc.from_request({"stop": "\n\n", "stop_token_ids": [7], "seed": 3, "presence_penalty": 0.5,
                           "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1,
                           "logit_bias": {"42": -100}, "n": 2})
    assert got == {"stop": ["\n\n"], "stop_token_ids": [7], "seed": 3, "presence_penalty": 0.5,
                   "frequency_penalty": -1.0, "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"42": -100.0},
                   "n": 2}
    assert rc.kinds(got) == ["stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty",
                             "repetition_penalty", "min_p", "logit_bias", "n"]
    assert rc.kind(got) == "settings" and rc.kind(None) == "none"


@pytest.mark.parametrize("request_, named", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strng"}}}}, "not a valid JSON"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format type"),
    ({"guided_regex": "([a-z]"}, "guided_regex does not compile"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": "json"}, "structured_outputs must be an object"),
    ({"stop": 5}, "stop must be"), ({"stop": ["a", 1]}, "stop must be"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"n": 0}, "n must be"), ({"n": 129}, "n must be"), ({"n": 1.5}, "n must be"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": "1"}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"a": 1}}, "logit_bias key"), ({"logit_bias": {"5": 200}}, "logit_bias[5]"),
    ({"seed": "x"}, "seed"),
    ({"guided_json": SCHEMA, "response_format": {"type": "json_object"}}, "both constrain"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "'missing'"),
    ({"tool_choice": "required"}, "no tools"),
])
def test_a_setting_the_api_refuses_is_an_error_naming_its_key(request_, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")):
        rc.from_request(request_)


def test_the_dedup_identity_is_what_shapes_the_answer_not_the_seed_or_n():
    schema = {"structured": {"kind": "regex", "spec": "a+"}}
    assert rc.identity(None) == rc.identity({"seed": 1, "n": 3}) == ""
    assert rc.identity({**schema, "seed": 1}) == rc.identity(schema) != rc.identity({"stop": ["x"]})
    assert rc.loads(rc.dumps(schema)) == schema and rc.dumps(None) is None


def test_sampling_kwargs_are_what_vllms_sampling_params_take():
    got = rc.sampling_kwargs({"structured": {"kind": "choice", "spec": ["a", "b"]}, "stop": ["."],
                              "logit_bias": {"3": 1.0}, "repetition_penalty": 1.1, "seed": 5})
    assert got == {"stop": ["."], "repetition_penalty": 1.1, "logit_bias": {3: 1.0},
                   "structured_outputs": {"choice": ["a", "b"]}}
    assert rc.sampling_kwargs({"structured": {"kind": "json_object", "spec": None}}) == {
        "structured_outputs": {"json_object": True}}
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    got["structured_outputs"] = StructuredOutputsParams(**got["structured_outputs"])
    params = SamplingParams(temperature=0, max_tokens=8, **got)
    assert params.structured_outputs.choice == ["a", "b"] and params.stop == ["."]


@pytest.mark.parametrize("constraints, text, problem", [
    ({"structured": {"kind": "json_schema", "spec": SCHEMA}}, '{"label": "bug"}', None),
    ({"structured": {"kind": "json_schema", "spec": SCHEMA}}, '{"label": "other"}', "not valid under the schema"),
    ({"structured": {"kind": "json_schema", "spec": SCHEMA}}, '{"label": ', "not JSON"),
    ({"structured": {"kind": "json_object", "spec": None}}, "[1]", "not a JSON object"),
    ({"structured": {"kind": "regex", "spec": "[0-9]{3}"}}, "123", None),
    ({"structured": {"kind": "regex", "spec": "[0-9]{3}"}}, "1234", "does not match"),
    ({"structured": {"kind": "choice", "spec": ["yes", "no"]}}, "maybe", "not one of"),
])
def test_an_answer_is_checked_against_its_structured_constraint(constraints, text, problem):
    got = rc.check_answer(constraints, text)
    assert list(got) == ["problem"] and ((got["problem"] is None) if problem is None else problem in got["problem"])


def test_an_answer_without_a_structured_constraint_has_nothing_to_check():
    assert rc.check_answer({"stop": ["x"]}, "anything") == {} and rc.check_answer(None, "x") == {}


def test_a_regex_answer_is_read_as_the_grammar_backend_reads_it_dot_matching_a_newline(tiny_target):
    """xgrammar (vLLM's backend) lets `.` match a newline, as Python's re.DOTALL does: an answer the backend
    decoded is valid, not counted invalid."""
    import xgrammar as xgr

    pattern, answer = "Reason: .+\\nVerdict: (yes|no)", "Reason: it rained\nall day\nVerdict: no"
    matcher = rc._matcher(tiny_target.tokenizer, 1024, tuple(tiny_target.stop_token_ids()), "regex",
                          json.dumps(pattern))
    assert matcher.accept_string(answer) and isinstance(matcher, xgr.GrammarMatcher)  # the backend takes it
    assert rc.check_answer({"structured": {"kind": "regex", "spec": pattern}}, answer) == {"problem": None}


def test_a_regex_that_backtracks_without_end_leaves_the_answer_unchecked_in_bounded_time():
    import time

    started = time.monotonic()
    got = rc.check_answer({"structured": {"kind": "regex", "spec": "(a|aa)+b"}}, "a" * 80)
    assert time.monotonic() - started < 10 * rc.REGEX_CHECK_SECONDS
    assert got == {"unchecked": f"the regex took over {rc.REGEX_CHECK_SECONDS:g} s on this answer"}


def test_an_answer_under_a_grammar_is_unchecked_never_counted_valid():
    got = rc.check_answer({"structured": {"kind": "grammar", "spec": 'root ::= "a" | "b"'}}, "c")
    assert got == {"unchecked": "a grammar is read only by the decoder's own matcher"}


@pytest.fixture
def silent_server():
    """A local socket that listens and never answers: a fetch of a $ref there would hang (no timeout)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(BlockingIOError):  # nothing ever connected
            listener.accept()
    finally:
        listener.close()


def test_no_remote_ref_is_fetched_when_an_answer_is_checked(silent_server):
    """A schema stored before ingest refused remote $refs: the check resolves nothing outside the schema, at once."""
    import time

    schema = {"type": "object", "properties": {"a": {"$ref": f"{silent_server}/a.json"}}}
    started = time.monotonic()
    got = rc.check_answer({"structured": {"kind": "json_schema", "spec": schema}}, '{"a": 1}')
    assert time.monotonic() - started < 5
    assert list(got) == ["unchecked"] and "is not resolved here" in got["unchecked"]
    local = {"$defs": {"x": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/x"}}}
    assert rc.check_answer({"structured": {"kind": "json_schema", "spec": local}}, '{"a": "s"}')["problem"]


def test_a_schema_with_a_remote_ref_is_refused_naming_it(silent_server):
    for ref in (f"{silent_server}/a.json", "other.json#/x", "/abs"):
        with pytest.raises(ValueError, match=r"guided_json's schema has a remote \$ref \(only '#\.\.\.' refs are "
                                             r"resolved, none is fetched\)"):
            rc.from_request({"guided_json": {"type": "object", "properties": {"a": {"$dynamicRef": ref}
                                                                              if ref == "/abs" else {"$ref": ref}}}})
    inner = {"$defs": {"x": {"type": "string"}}, "properties": {"a": {"$ref": "#/$defs/x"}}}
    assert rc.from_request({"guided_json": inner}) == {"structured": {"kind": "json_schema", "spec": inner}}


def nested_schema(levels: int) -> dict:
    schema = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_deeper_than_the_limit_is_refused_naming_the_depth():
    deepest = nested_schema((rc.MAX_SCHEMA_DEPTH - 1) // 2)  # two JSON levels per nested object
    assert rc.from_request({"guided_json": deepest})["structured"]["spec"] == deepest
    for schema in (nested_schema(rc.MAX_SCHEMA_DEPTH // 2 + 1), nested_schema(300)):
        for request in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
            with pytest.raises(ValueError, match=f"schema is nested more than {rc.MAX_SCHEMA_DEPTH} levels deep"):
                rc.from_request(request)


# --- the own loops ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("request_, error", [
    ({"guided_choice": [str(i) for i in range(rc.MAX_CHOICES + 1)]},
     "guided_choice has 5,001 strings, over the limit of 5,000 (its grammar would take minutes to compile)"),
    ({"structured_outputs": {"choice": ["x" * 60_000, "y" * 60_000]}},
     "structured_outputs.choice is 120,000 characters long, over the limit of 100,000"),
    ({"guided_regex": "a" * 100_001}, "guided_regex is 100,001 characters long, over the limit of 100,000"),
    ({"guided_grammar": 'root ::= "' + "a" * 100_000 + '"'},
     "guided_grammar is 100,011 characters long, over the limit of 100,000"),
    ({"guided_json": {"enum": ["a" * 100_000]}},
     "guided_json's schema is 100,014 characters long, over the limit of 100,000")])
def test_a_constraint_over_the_size_its_compile_is_bounded_by_is_refused_naming_its_key(request_, error):
    with pytest.raises(ValueError) as refused:
        rc.from_request(request_)
    assert str(refused.value) == error
    assert rc.from_request({"guided_choice": [str(i) for i in range(rc.MAX_CHOICES)]}) is not None


def test_logit_bias_and_penalties_apply_as_vllm_defines_them():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    rules = rc.Rules({"logit_bias": {"4": 10.0}, "repetition_penalty": 2.0, "frequency_penalty": 0.5,
                      "presence_penalty": 0.25}, tokenizer=None, vocab_size=5, stop_ids=[], prompt_ids=[0])
    rules.output = [1, 1, 3]
    expected = logits.clone()
    expected[4] += 10.0
    expected[0] /= 2.0  # in the prompt: positive logit divided
    expected[1] *= 2.0  # in the answer: negative logit multiplied
    expected[3] /= 2.0
    expected[1] -= 0.5 * 2 + 0.25  # frequency x count + presence
    expected[3] -= 0.5 * 1 + 0.25
    torch.testing.assert_close(rules.process(logits), expected)
    assert rules.accept(2) is False and rules.output == [1, 1, 3, 2]


def test_the_grammar_mask_leaves_only_tokens_that_keep_the_answer_valid(tiny_target):
    pytest.importorskip("xgrammar")
    tok, vocab = tiny_target.tokenizer, tiny_target.config.vocab_size
    stop = tiny_target.stop_token_ids()
    rules = rc.Rules({"structured": {"kind": "choice", "spec": ["yes", "no"]}}, tok, vocab, stop, [1, 2])
    generator = torch.Generator().manual_seed(0)
    out = []
    for _ in range(8):
        logits = rules.process(torch.randn(vocab, generator=generator))
        token = int(logits.argmax())
        out.append(token)
        rules.accept(token)
        if token in stop:
            break
    assert out[-1] in stop and tok.decode(out[:-1]) in ("yes", "no")
    with pytest.raises(RuntimeError, match="outside the grammar"):
        fresh = rc.Rules({"structured": {"kind": "regex", "spec": "[0-9]+"}}, tok, vocab, stop, [1])
        fresh.accept(tok.encode("abc", add_special_tokens=False)[0])


def test_a_stop_string_ends_the_answer_at_the_token_that_completes_it(tiny_target):
    tok = tiny_target.tokenizer
    ids = tok.encode("one two. three", add_special_tokens=False)
    rules = rc.Rules({"stop": [". t"]}, tok, tiny_target.config.vocab_size, [], [])
    ended = [rules.accept(t) for t in ids]
    first = ended.index(True)
    assert ". t" in tok.decode(ids[:first + 1]) and ". t" not in tok.decode(ids[:first])


def test_min_p_in_sampling_is_left_to_vllm_in_one_line():
    rc.check_replayable({"min_p": 0.1}, greedy=True, where="prompt a")  # greedy: changes nothing, as in vLLM
    with pytest.raises(ValueError, match="prompt a: min_p 0.1 .* --engine vllm"):
        rc.check_replayable({"min_p": 0.1}, greedy=False, where="prompt a")
