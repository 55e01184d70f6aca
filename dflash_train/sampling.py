"""Decoding settings, checked and normalised the way the OpenAI chat-completions API defines them. The one place
that says what a logged `temperature`, `top_p` or `max_tokens` means, and the range of every other number a request
sets: ingest checks logged requests with it, capture and eval check their flags, each prompt record's settings
(`check_record`) and resolve each prompt's settings with it.

    temperature  a number in [0, 2]; 0 = greedy (argmax)
    top_p        a number in [0, 1]; nucleus sampling over the smallest set of most likely tokens whose
                 probability reaches top_p, which always holds the most likely token, so top_p 0 = greedy
    max_tokens   an integer >= 1 (`max_completion_tokens` is its newer name)

and, of the request's other settings (`constraints`), the ranges that vLLM (`SamplingParams._verify_args`) and the
project's own loops both take:

    seed                 an integer in [0, 2**63 - 1]: vLLM's API takes an int64 and reads -1 as no seed,
                         torch.Generator.manual_seed takes up to 2**64 - 1 and reads a negative seed as 2**64 + seed,
                         so only these seed both engines alike
    presence_penalty, frequency_penalty   in [-2, 2]
    repetition_penalty   a finite number > 0
    min_p                in [0, 1]
    logit_bias           {token id: bias in [-100, 100]}, each id in the target's vocabulary (its config's
                         vocab_size, as vLLM counts it); stop_token_ids too

A value outside its range, non-finite, or not a number is a request the API refuses with an error, so a logged
request that carries one was never served as logged: ingest counts it as a bad record (`bad_sampling`) instead of
guessing. A setting the request left out is stored as null; capture then decodes greedily unless its flags say
otherwise (the API's own default temperature is 1: pass `--temperature 1` to replay such traffic as served).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypedDict

RANGES = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}


RequestBody = dict[str, Any]
"""A chat-completions request body as logged (OpenAI's API, with vLLM's extras, or a log's own record holding the
same keys): an open JSON object, read here for its settings and by `constraints.from_request` for the rest."""


class LoggedSettings(TypedDict):
    """A prompt record's `sampling`: the decoding settings its request logged (`logged`), null where not logged."""
    temperature: float | None
    top_p: float | None
    max_tokens: int | None


@dataclass(frozen=True)
class Sampling:
    """How one prompt is decoded, normalised: greedy is always (0.0, 1.0)."""
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check(name: str, value: Any) -> float:
    """`value` as a float if it is a valid `name` (temperature or top_p), else ValueError saying why."""
    low, high = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
    number = float(value)
    if not math.isfinite(number) or not low <= number <= high:
        raise ValueError(f"{name} must be a finite number in [{low:g}, {high:g}], got {value!r}")
    return number


def flag_check(name: str):
    """The options check of a `--temperature` / `--top-p` flag: None (not given) or a valid value."""
    low, high = RANGES[name]

    def check_flag(value: Any) -> str | None:
        if value is None:
            return None
        try:
            check(name, value)
        except ValueError:
            return f"must be a finite number in [{low:g}, {high:g}] (the OpenAI API's range)"
        return None
    return check_flag


MAX_TOKENS_LIMIT = 2**63 - 1  # the prompt table's int64 column


def check_max_tokens(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value != int(value) or not 1 <= value <= MAX_TOKENS_LIMIT:
        raise ValueError(f"max_tokens must be an integer in [1, 2**63 - 1], got {value!r}")
    return int(value)


SEED_RANGE = (0, 2**63 - 1)
SETTING_RANGES = {"presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
                  "repetition_penalty": (0.0, math.inf), "min_p": (0.0, 1.0)}  # repetition_penalty: low bound open
LOGIT_BIAS_RANGE = (-100.0, 100.0)


def check_seed(value: Any) -> int:
    low, high = SEED_RANGE
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"seed must be an integer in [0, 2**63 - 1] (what both engines seed alike), got "
                         f"{_shown(value)}")
    return value


def check_setting(name: str, value: Any) -> float:
    """`value` as a float if it is a valid `name` (a key of SETTING_RANGES), else ValueError naming it."""
    low, high = SETTING_RANGES[name]
    bounds = f"a finite number > {low:g}" if name == "repetition_penalty" else f"a number in [{low:g}, {high:g}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not low <= value <= high or (name == "repetition_penalty" and value == low):
        raise ValueError(f"{name} must be {bounds}, got {_shown(value)}")
    return float(value)


def check_logit_bias(bias: Any, vocab_size: int | None = None) -> dict[str, float]:
    """A logit_bias as {"token id": bias}, each bias in range and, with `vocab_size`, each id in the vocabulary;
    ValueError naming the entry otherwise."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {_shown(bias)}")
    low, high = LOGIT_BIAS_RANGE
    out = {}
    for token, value in bias.items():
        if not str(token).isdigit():
            raise ValueError(f"logit_bias key {token!r} is not a token id")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise ValueError(f"logit_bias[{token}] must be a number in [{low:g}, {high:g}], got {_shown(value)}")
        out[str(int(token))] = float(value)
    if vocab_size is not None:
        check_token_ids("logit_bias", [int(t) for t in out], vocab_size)
    return out


def check_token_ids(key: str, ids: list[int], vocab_size: int) -> None:
    outside = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size]
    if outside:
        raise ValueError(f"{key} names token id {outside[0]}, outside the target's vocabulary (ids 0 to "
                         f"{vocab_size - 1})")


def check_record(settings: LoggedSettings | None, constraints: dict[str, Any] | None,
                 vocab_size: int | None = None) -> None:
    """A prompt record's stored settings (`sampling`) and constraints, checked by the same ranges ingest read them
    with (a folder written by an older ingest, or edited, may hold any value); with `vocab_size`, also the token ids
    they name. ValueError naming the key otherwise."""
    settings, c = settings or {}, constraints or {}
    for name in RANGES:
        if settings.get(name) is not None:
            check(name, settings[name])
    if settings.get("max_tokens") is not None:
        check_max_tokens(settings["max_tokens"])
    if c.get("seed") is not None:
        check_seed(c["seed"])
    for name in SETTING_RANGES:
        if c.get(name) is not None:
            check_setting(name, c[name])
    if c.get("logit_bias") is not None:
        check_logit_bias(c["logit_bias"], vocab_size)
    if vocab_size is not None and c.get("stop_token_ids"):
        check_token_ids("stop_token_ids", c["stop_token_ids"], vocab_size)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def logged(request: RequestBody) -> LoggedSettings:
    """The decoding settings of a logged request ({temperature, top_p, max_tokens}, null where not logged);
    ValueError naming the key when one is not valid. Numbers logged as strings ("0.7") are read as numbers."""
    def number(key: str) -> Any:
        value = request.get(key)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise ValueError(f"{key} must be a number, got {value!r}") from None
        return value

    max_tokens = number("max_tokens") if request.get("max_tokens") is not None else number("max_completion_tokens")
    temperature, top_p = number("temperature"), number("top_p")
    return {"temperature": None if temperature is None else check("temperature", temperature),
            "top_p": None if top_p is None else check("top_p", top_p),
            "max_tokens": None if max_tokens is None else check_max_tokens(max_tokens)}


def response_cap(max_new_tokens: int, logged_settings: LoggedSettings | None = None) -> int:
    """The most tokens a response may have: the stage's cap, or the request's logged max_tokens where smaller (the
    application's own limit is part of how the target is served)."""
    logged_max = (logged_settings or {}).get("max_tokens")
    return min(max_new_tokens, logged_max) if logged_max else max_new_tokens


def resolve(temperature: float | None, top_p: float | None,
            logged_settings: LoggedSettings | None = None) -> Sampling:
    """A prompt's settings: each given one wins over the logged one; what neither gives is greedy / top_p 1.
    ValueError when a value is out of range. temperature 0 or top_p 0 -> greedy (0.0, 1.0)."""
    logged_settings = logged_settings or {}
    t = temperature if temperature is not None else logged_settings.get("temperature")
    p = top_p if top_p is not None else logged_settings.get("top_p")
    t = 0.0 if t is None else check("temperature", t)
    p = 1.0 if p is None else check("top_p", p)
    if t == 0.0 or p == 0.0:
        return Sampling()
    return Sampling(temperature=t, top_p=p)
