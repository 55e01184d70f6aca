"""Writes the hostile log of issue 63's run: the first 2,000 requests of the shipped router workload
(`data/workloads/router_json.jsonl.gz`) with one request in twenty (every twentieth, 100 in all) replaced by a
request that is malformed in one of the ways real logs are, the kinds taking turns. Each keeps its user message and
system prompt; only what the client sent besides is hostile.

    python results/hostile_log/make_log.py OUT.jsonl.gz PORT

PORT: a local port a listener watches during the run; the remote `$ref`s point at it (and at a host that does not
resolve), so that any fetch would show as a connection there.
"""

from __future__ import annotations

import copy
import gzip
import json
import sys

N, EVERY = 2000, 20


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def kinds(port: int) -> list[tuple[str, dict]]:
    """(kind, what replaces or joins the request's own fields); None deletes a field."""
    json_schema = lambda schema: {"response_format": {"type": "json_schema",  # noqa: E731
                                                      "json_schema": {"name": "route", "schema": schema}}}
    return [
        ("logit_bias id outside the vocabulary", {"logit_bias": {"999999": 5}}),
        ("schema nested 70 levels", json_schema(nested(70))),
        ("regex with a lookahead", {"response_format": None,
                                    "extra_body": {"structured_outputs": {"regex": "(?=a)a+"}}}),
        ("seed 2**80", {"seed": 2**80}),
        ("remote $ref to a local port", json_schema({"type": "object", "properties": {
            "intent": {"$ref": f"http://127.0.0.1:{port}/route.json"}}})),
        ("remote $ref to a host that does not resolve", json_schema({"$ref": "http://schemas.invalid/route.json"})),
        ("schema nested 300 levels", json_schema(nested(300))),
        ("guided_choice of 50,000 strings", {"response_format": None,
                                             "guided_choice": [f"label {i}" for i in range(50_000)]}),
        ("EBNF grammar that does not parse", {"response_format": None, "guided_grammar": 'root ::= "on" | ('}),
        ("presence_penalty 9", {"presence_penalty": 9}),
        ("max_tokens -5", {"max_tokens": -5}),
        ("temperature 5", {"temperature": 5}),
        ("logit_bias on a token id the target has (vLLM refuses it with speculative decoding)",
         {"logit_bias": {"100": 1}}),
        ("min_p 0.1 (vLLM refuses it with speculative decoding)", {"min_p": 0.1}),
        ("nested quantifiers (Python's re backtracks exponentially on them)",
         {"response_format": None, "guided_regex": "\\{\"intent\": \"(a+)+\"\\}"}),
    ]


def main(out: str, port: int) -> None:
    with gzip.open("data/workloads/router_json.jsonl.gz", "rt") as f:
        rows = [json.loads(line) for _, line in zip(range(N), f)]
    hostile = kinds(port)
    for j, i in enumerate(range(EVERY - 1, N, EVERY)):
        kind, fields = hostile[j % len(hostile)]
        row = copy.deepcopy(rows[i])
        row["id"] = f"hostile-{j:03d}"
        row["kind"] = kind  # beside the request, as a logging proxy's own annotation: ingest reads `request`
        for key, value in fields.items():
            if value is None:
                row["request"].pop(key, None)
            else:
                row["request"][key] = value
        rows[i] = row
    with open(out, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, mtime=0) as z:
        z.write("".join(json.dumps(row) + "\n" for row in rows).encode())


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
