"""Writes `triage.jsonl.gz`, the structured application log `scripts/demo.py --logs` was run on unseen: a software
help desk's ticket triage, 1,381 requests (every eligible opening message in its range, in a shuffled
order) as an OpenAI-compatible vLLM server logs them.

Written for the run in this folder, after the demo's planner and defaults were settled and before any drafter was
measured on it; it is not a shipped workload (data/workloads), so nothing in the pipeline was tuned on it. It differs
from the router workload in everything the pipeline has to read: its system prompt and four keys, its constraint's
form (vLLM's `structured_outputs` in `extra_body`, as the openai client sends vLLM's extras, not `response_format`),
a per-request `seed`, `max_tokens` 96, and its inputs: the opening messages of ShareGPT conversations 5,200 to
7,999, which neither the general drafter's training prompts (conversations 0 to about 5,100) nor the shipped
workloads (8,000 and later) hold.

    python results/demo_unseen_triage/make_log.py OUT.jsonl.gz
"""

from __future__ import annotations

import gzip
import json
import random
import re
import sys

SYSTEM = ("You are the triage assistant of a software company's help desk. Read the customer's message and reply "
          "with a JSON object only, with these keys: \"category\" (one of \"bug\", \"billing\", \"account\", "
          "\"how_to\", \"feature_request\", \"other\"), \"priority\" (one of \"low\", \"normal\", \"high\", "
          "\"urgent\"), \"sentiment\" (one of \"positive\", \"neutral\", \"negative\") and \"summary\" (one "
          "sentence for the agent who picks the ticket up).")
SCHEMA = {"type": "object",
          "properties": {"category": {"enum": ["bug", "billing", "account", "how_to", "feature_request", "other"]},
                         "priority": {"enum": ["low", "normal", "high", "urgent"]},
                         "sentiment": {"enum": ["positive", "neutral", "negative"]},
                         "summary": {"type": "string"}},
          "required": ["category", "priority", "sentiment", "summary"], "additionalProperties": False}
FIRST, END = 5200, 8000
CREATED = 1_767_000_000  # one request every 11 s


def main(out: str) -> None:
    from dflash_train.stages.ingest.command import default_logs

    raw = default_logs()[0].read_text(errors="replace")
    conversations = json.loads(raw[:raw.rfind("\n  },") + len("\n  }")] + "\n]")  # whole records before the cut
    texts = []
    for conv in conversations[FIRST:END]:
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and isinstance(turns[0].get("value"), str):
            text = re.sub(r"[ \t]+\n", "\n", turns[0]["value"]).strip()
            if 20 <= len(text) <= 1500:
                texts.append(text)
    picked = random.Random(2026_12_05).sample(texts, len(texts))
    lines = [json.dumps({"id": f"triage-{i:05d}", "created": CREATED + 11 * i,
                         "request": {"model": "smollm2-135m-instruct",
                                     "messages": [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": text}],
                                     "temperature": 0, "max_tokens": 96, "seed": 1000 + i,
                                     "extra_body": {"structured_outputs": {"json": SCHEMA}}}},
                        ensure_ascii=False) + "\n" for i, text in enumerate(picked)]
    with open(out, "wb") as f, gzip.GzipFile(fileobj=f, mode="wb", compresslevel=9, mtime=0) as z:
        z.write("".join(lines).encode("utf-8"))
    print(f"{out}: {len(lines)} requests (of {len(texts)} eligible opening messages)")


if __name__ == "__main__":
    main(sys.argv[1])
