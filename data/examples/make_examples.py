"""Writes the small example logs in this folder, one per supported input format (run from anywhere:
`python data/examples/make_examples.py`). The files are committed; tests and docs read them, not this script.

Every secret, e-mail, phone and card number below is fake (documentation ranges and test numbers)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEM = "You are a concise assistant for an online bike shop."


def chat(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def completion(text: str) -> dict:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "shop-assistant",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}]}


# OpenAI chat-completions request logs: request + logged response
OPENAI_REQUESTS = [
    {"request": {"model": "shop-assistant", "messages": [
        chat("system", SYSTEM), chat("user", "Which tyre pressure should I use for a 28 mm road tyre?")],
                 "temperature": 0.7, "top_p": 0.9, "max_tokens": 256},
     "response": completion("Around 5.5 to 6.5 bar, depending on your weight.")},
    {"request": {"model": "shop-assistant", "messages": [
        chat("system", SYSTEM),
        chat("user", "I ordered a helmet last week."),
        chat("assistant", "Thanks! How can I help with that order?"),
        chat("user", "Please send the invoice to maria.lopez@example.com and call me at (415) 555-0132 if needed.")],
        "temperature": 0.2, "max_tokens": 128},
     "response": completion("Done: the invoice is on its way.")},
    {"request": {"model": "shop-assistant", "messages": [
        chat("user", "My card 4111 1111 1111 1111 was charged twice, order number 1234 5678 9012 3456.")],
        "temperature": 0.0},
     "response": completion("Sorry about that! I have asked billing to refund the second charge.")},
    {"request": {"model": "shop-assistant", "messages": [
        chat("user", "Our checkout server 203.0.113.42 runs app version 1.2.3 and firmware v10.0.1.5. Is it safe?")]},
     "response": None},
    {"request": {"model": "shop-assistant", "messages": [
        chat("user", [{"type": "text", "text": "Translate to French:"},
                      {"type": "text", "text": "Where is the shop?"}])],
        "temperature": 1.0, "top_p": 0.95, "max_completion_tokens": 64},
     "response": completion("Où est le magasin ?")},
    # the same prompt as the first one, differing only in case and whitespace: a duplicate
    {"request": {"model": "shop-assistant", "messages": [
        chat("system", SYSTEM), chat("user", "which tyre pressure  should I use for a 28 mm ROAD tyre?")],
                 "temperature": 0.7, "top_p": 0.9, "max_tokens": 256},
     "response": completion("About 6 bar.")},
]

# bare {"messages": [...]} logs, sampling next to them
MESSAGES = [
    {"messages": [chat("user", "Write a haiku about chain grease.")], "temperature": 0.8},
    {"messages": [chat("system", "You answer in one sentence."),
                  chat("user", "Why do disc brakes squeal?"),
                  chat("assistant", "Usually contaminated pads or glazed rotors.")]},
    {"messages": [chat("user", "Here is my config: api_key = sk-proj-4fT9xQ2mLp8ZrV6nB1cW7yK3hJ5dS0aE, "
                               "hf token hf_QwErTyUiOpAsDfGhJkLzXcVbNm1234567890 and AWS key AKIAIOSFODNN7EXAMPLE. "
                               "Is scikit-learn (sk-learn) installed?")]},
    {"messages": [chat("user", "curl -H 'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl' "
                               "https://api.example.com/orders fails with 401, why? The bearer of bad news is me.")]},
    {"messages": [chat("user", "Is this key valid?\n-----BEGIN RSA PRIVATE KEY-----\n"
                               "MIIBOgIBAAJBAKj34GkxFhD90vcNLYLInFEX6Ppy1tPf9Cnzj4p4WGeKLs1Pt8Qu\n"
                               "KUpRKfFLfRYC9AIKjbJTWit+CqvjWYzvQwECAwEAAQJAIJLixBy2qpFoS4DSmoEm\n"
                               "-----END RSA PRIVATE KEY-----\nThanks!")]},
]

# ShareGPT conversations: human/gpt/system; the prompt ends at the last human turn
SHAREGPT = [
    {"id": "a1", "conversations": [{"from": "human",
                                    "value": "What is the difference between a cassette and a freewheel?"},
                                   {"from": "gpt", "value": "A cassette slides onto a freehub body; a freewheel "
                                                            "screws onto the hub and contains the ratchet."}]},
    {"id": "a2", "conversations": [{"from": "system", "value": "You are a bike mechanic."},
                                   {"from": "human", "value": "How do I index a rear derailleur?"},
                                   {"from": "gpt", "value": "Shift to the smallest cog, set the cable tension, "
                                                            "then adjust the barrel adjuster."},
                                   {"from": "human", "value": "And if it still skips on the big cogs?"},
                                   {"from": "gpt", "value": "Check the B-tension screw and the hanger alignment."}]},
    {"id": "a3", "conversations": [{"from": "human", "value": "Suggest three names for a cycling club."},
                                   {"from": "gpt", "value": "Spoke Folk, Chain Gang, Pedal Pushers."},
                                   {"from": "human", "value": "Shorter ones, please."}]},
    {"id": "a4", "conversations": [{"from": "human", "value": "Contact our mechanic at +44 20 7946 0958 for repairs."},
                                   {"from": "gpt", "value": "Noted."},
                                   {"from": "human", "value": ""}]},
]

SHAREGPT_GZ = [
    {"id": "b1", "conversations": [{"from": "human", "value": "Explain gear inches in two sentences."},
                                   {"from": "gpt", "value": "Gear inches give the effective wheel diameter of a "
                                                            "gear. Higher numbers mean harder pedalling."}]},
    {"id": "b2", "conversations": [{"from": "human", "value": "Plan a 3-day bike tour around a lake."}]},
    {"id": "b3", "conversations": [{"from": "human", "value": "How often should I wax a chain?"},
                                   {"from": "gpt", "value": "Every 300 to 500 km, sooner in the wet."}]},
]

PROMPTS = [
    {"prompt": "List five essentials for a long ride.", "temperature": 0.5},
    {"prompt": "list five essentials   for a LONG ride."},
    {"prompt": "List five essentials for a long ride.", "response": "Water, food, tools, lights, a phone."},
    {"prompt": "What does 'tubeless ready' mean?", "max_tokens": 200},
]

PARQUET_ROWS = [
    {"request": {"model": "shop-assistant", "messages": [chat("user", "Do you ship to Norway?")],
                 "temperature": 0.3, "top_p": 1.0, "max_tokens": 64},
     "response": completion("Yes, shipping to Norway takes 3 to 5 days.")},
    {"request": {"model": "shop-assistant", "messages": [chat("system", SYSTEM),
                                                         chat("user", "Can I return worn shoes?")],
                 "temperature": 0.3, "top_p": None, "max_tokens": None},
     "response": completion("Only unworn items can be returned.")},
    {"request": {"model": "shop-assistant", "messages": [chat("user", "Is the frame size M fine for 178 cm?")],
                 "temperature": None, "top_p": None, "max_tokens": 32},
     "response": None},
]

# Five good records and one of each kind of bad line: malformed JSON, an unknown shape, an empty prompt,
# bytes that are not UTF-8. 4 of 9 are bad: under the default --max-bad-fraction 0.5.
BAD_LINES = [
    json.dumps({"prompt": "How do I true a wheel at home?"}).encode(),
    b'{"prompt": "this line is cut off',
    json.dumps({"prompt": "What is a thru-axle?"}).encode(),
    json.dumps({"text": "an unknown shape"}).encode(),
    json.dumps({"messages": [chat("user", "   ")]}).encode(),
    b"",  # a blank line: not a record
    json.dumps({"prompt": "Which chain fits an 11-speed cassette?"}).encode(),
    b'{"prompt": "caf\xe9 racer handlebars?"}',  # latin-1 bytes
    json.dumps({"conversations": [{"from": "human", "value": "Are tubeless tyres worth it?"}]}).encode(),
    json.dumps({"request": {"messages": [chat("user", "Best lube for winter?")]}}).encode(),
]


def write_jsonl(path: Path, records: list[dict], opener=open) -> None:
    with opener(path, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def main() -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    write_jsonl(HERE / "openai_requests.jsonl", OPENAI_REQUESTS)
    write_jsonl(HERE / "messages.jsonl", MESSAGES)
    (HERE / "sharegpt.json").write_text(json.dumps(SHAREGPT, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    with gzip.GzipFile(HERE / "sharegpt.jsonl.gz", "wb", mtime=0) as f:  # mtime 0: byte-identical reruns
        for record in SHAREGPT_GZ:
            f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    write_jsonl(HERE / "prompts.jsonl", PROMPTS)
    pq.write_table(pa.Table.from_pylist(PARQUET_ROWS), HERE / "requests.parquet")
    (HERE / "bad_lines.jsonl").write_bytes(b"\n".join(BAD_LINES) + b"\n")


if __name__ == "__main__":
    main()
