"""PII and secrets scrubbing for ingest: find them in text and replace each with a typed placeholder (<EMAIL>, ...).

Where a field library knows a format, it decides; regular expressions here only find candidates for it:

    phonenumbers   (Google's libphonenumber metadata) whether a candidate is a valid phone number of a country
    python-stdnum  IBAN (country format + mod-97 check), US SSN (the ranges never issued), Luhn for card numbers
    detect-secrets vendor credential formats (GitHub, GitLab, Slack, Stripe, AWS key ids, JWTs with their JSON
                   check, SendGrid, Twilio, PyPI, ...) and the Shannon entropy of high-entropy strings
    ipaddress      (standard library) IPv4 and IPv6 addresses

detect-secrets scans source files line by line; only its format patterns are used here (its keyword and
basic-auth detectors take the rest of the line, or miss passwords with `!` or `$`), each match extended to the
end of its token. Formats it lacks (GitHub fine-grained `github_pat_`, Google API keys `AIza`, Stripe test keys,
Hugging Face and OpenAI-style `sk-` keys) are patterns here, as are passwords in URLs and in assignments.

Kinds, in priority order (where two findings overlap, the earlier kind wins): see `KINDS`. What survives on
purpose (tests/test_pii.py holds the corpus): versions (`1.2.3.4`, `OpenSSL 1.1.1.1`: dotted quads of single
digits, or after `version`/`v`/`==`), loopback, unspecified and broadcast addresses, hex hashes and UUIDs,
git SSH remotes (`git@github.com:org/repo.git`), image names (`logo@2x.png`), numbers after `#` or an order,
invoice or ticket word, dates, prices, decimals, the digit sequence 0123456789, and code that passes a
variable (`password=password`, `password: str`, `password = input(...)`).

Phone numbers without a country code are read as national numbers: a number with a trunk 0 (`020 7946 0958`)
is a phone number when it is valid in one of PHONE_REGIONS; one without is valid when it is a North American
(NANP) or Indian mobile number. A bare run of 10 digits follows the same rule: `4155552671` (a NANP number in
service format) is a phone number, `1234567890` and Unix times such as `1700000000` (no NANP area code starts
with 0 or 1) are not.
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
import math
import re
from collections import Counter
from typing import Callable, Iterator

import phonenumbers
from detect_secrets.plugins import (aws, github_token, gitlab_token, jwt, mailchimp, openai, pypi_token, sendgrid,
                                    slack, square_oauth, stripe, twilio)
from detect_secrets.plugins.high_entropy_strings import Base64HighEntropyString
from stdnum import iban, luhn
from stdnum.us import ssn

KINDS = ("private_key", "jwt", "bearer_token", "github_token", "slack_token", "stripe_key", "google_api_key",
         "aws_key", "aws_secret_key", "hf_token", "api_key", "password", "secret", "email", "iban", "credit_card",
         "ssn", "ipv6", "ipv4", "phone")

Span = tuple[int, int, str]  # start, end, kind

# ------------------------------------------------------------------------------------------------ secrets

_TOKEN_CHARS = re.compile(r"[A-Za-z0-9_\-]{0,200}")
_TOKEN_BEFORE = re.compile(r"[A-Za-z0-9_\-]")

# detect-secrets format patterns -> our kind, each run only when one of its needles is in the text. AWS's second
# pattern (a quoted 40-character secret near "aws" and "key") is the aws_secret_key detector below, which also
# finds it unquoted; Azure's AccountKey=... is a high-entropy secret there too.
_GITLAB = ("glpat-", "gldt-", "glft-", "glsoat-", "glrt-", "GR1348941", "glcbt-", "glimt-", "glptt-", "glagent-",
           "gloas-")
_VENDOR_PATTERNS: list[tuple[re.Pattern, str, tuple[str, ...]]] = [
    (github_token.GitHubTokenDetector.denylist[0], "github_token", ("ghp_", "gho_", "ghu_", "ghs_", "ghr_")),
    (re.compile(r"(?<![A-Za-z0-9_\-])github_pat_[A-Za-z0-9]{22}_[A-Za-z0-9]{59}"), "github_token", ("github_pat_",)),
    *[(p, "slack_token", ("xox", "XOX", "hooks.slack", "HOOKS.SLACK")) for p in slack.SlackDetector.denylist],
    (stripe.StripeDetector.denylist[0], "stripe_key", ("_live_",)),
    (re.compile(r"(?<![A-Za-z0-9_\-])(?:sk|rk)_test_[0-9a-zA-Z]{24}"), "stripe_key", ("_test_",)),
    (re.compile(r"(?<![A-Za-z0-9_\-])AIza[0-9A-Za-z_\-]{35}"), "google_api_key", ("AIza",)),
    (aws.AWSKeyDetector.denylist[0], "aws_key", ("AKIA", "ASIA", "ABIA", "ACCA", "A3T")),
    (re.compile(r"(?<![A-Za-z0-9_\-])hf_[A-Za-z0-9]{30,}"), "hf_token", ("hf_",)),
    (re.compile(r"(?<![A-Za-z0-9_\-])sk-[A-Za-z0-9_\-]{20,}"), "api_key", ("sk-",)),  # OpenAI (sk-, sk-proj-), Anthropic (sk-ant-)
    (openai.OpenAIDetector.denylist[0], "api_key", ("T3BlbkFJ",)),
    *[(p, "api_key", _GITLAB) for p in gitlab_token.GitLabTokenDetector.denylist],
    *[(p, "api_key", ("pypi-",)) for p in pypi_token.PypiTokenDetector.denylist],
    (sendgrid.SendGridDetector.denylist[0], "api_key", ("SG.",)),
    *[(p, "api_key", ("AC", "SK")) for p in twilio.TwilioKeyDetector.denylist],
    (mailchimp.MailchimpDetector.denylist[0], "api_key", ("-us",)),
    (square_oauth.SquareOAuthDetector.denylist[0], "api_key", ("sq0csp-",)),
]


_VENDOR_NEEDLES = re.compile("|".join(sorted({re.escape(n) for _, _, needles in _VENDOR_PATTERNS for n in needles},
                                              key=len, reverse=True)))


def _vendor_keys(t: _Text) -> Iterator[Span]:
    text = t.text
    present = set(_VENDOR_NEEDLES.findall(text))
    if not present:
        return
    for pattern, kind, needles in _VENDOR_PATTERNS:
        if present.isdisjoint(needles):
            continue
        for m in pattern.finditer(text):
            group = 1 if pattern.groups and m.group(1) else 0
            start = m.start(group)
            if start > 0 and _TOKEN_BEFORE.match(text, start - 1) and kind != "slack_token":
                continue  # the middle of a longer word, not a key
            yield start, _TOKEN_CHARS.match(text, m.end(group)).end(), kind  # the key runs to its token's end


# detect-secrets' JWT pattern backtracks quadratically over a long run of base64 ("eyJeyJ..."): the same shape,
# started at token starts only; its validator decides.
_JWT = re.compile(r"(?<![A-Za-z0-9_=\-])eyJ[A-Za-z0-9_=\-]*\.[A-Za-z0-9_=\-]+(?:\.[A-Za-z0-9_=\-]*)?")


def _jwts(t: _Text) -> Iterator[Span]:
    text = t.text
    if "eyJ" not in text:
        return
    for m in _JWT.finditer(text):
        if jwt.JwtTokenDetector.is_formally_valid(m.group()):  # header and payload decode to JSON
            yield m.start(), m.end(), "jwt"


_BEARER = re.compile(r"(?i)(?<![\w-])bearer\s+(?P<token>[A-Za-z0-9._~+/-]{16,}=*)")


def _bearer_tokens(t: _Text) -> Iterator[Span]:
    text = t.text
    if "earer" not in text and "EARER" not in text:
        return
    for m in _BEARER.finditer(text):
        token = m.group("token")
        if any(ch.isdigit() for ch in token) or len(token) >= 32:  # "bearer of bad news" is prose
            yield m.start("token"), m.end("token"), "bearer_token"


# The body (base64, Proc-Type/DEK-Info headers, newlines, or "\n" escapes when the key sits in a JSON or code
# string) never contains "-----": a BEGIN without an END stops at the next dashes instead of at the end of the
# text, and then only its base64 lines are replaced.
_PRIVATE_KEY = re.compile(
    r"-----BEGIN [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----(?:(?:[A-Za-z0-9+/=\s:,\\]|-(?!----))*?"
    r"-----END [A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|(?:(?:\s|\\[nr])*[A-Za-z0-9+/=]{16,})*)")


def _private_keys(t: _Text) -> Iterator[Span]:
    text = t.text
    if "PRIVATE KEY" in text:
        for m in _PRIVATE_KEY.finditer(text):
            yield m.start(), m.end(), "private_key"


_ENTROPY = Base64HighEntropyString()
_B64_TOKEN = re.compile(r"(?<![A-Za-z0-9+/=_\-.])[A-Za-z0-9+/_\-]{32,200}={0,2}(?![A-Za-z0-9+/=_\-])")
_AWS_CONTEXT = re.compile(r"(?i)aws|secret")
_NOT_SECRET_BEFORE = re.compile(r"(?i)base64,$")
_SRI = re.compile(r"sha(?:1|224|256|384|512)-")


_WORD = re.compile(r"[A-Z]?[a-z]{3,}")
_ALPHABET_RUNS = ("ABCDE", "abcde", "01234", "12345")


def _random_looking(token: str) -> bool:
    """Mixed case and digits, and the Shannon entropy (detect-secrets') of random base64 of that length: a
    hex hash (one case), a path in words or an identifier made of words (GetThumbnailAsBase64Async: 60% of its
    letters in words of 3+ lowercase letters, as 1% of random tokens are) or the base64 alphabet stays."""
    if not (any(c.isupper() for c in token) and any(c.islower() for c in token) and any(c.isdigit() for c in token)):
        return False
    if any(run in token for run in _ALPHABET_RUNS):
        return False
    if sum(len(w) for w in _WORD.findall(token)) >= 0.6 * sum(c.isalpha() for c in token):
        return False
    # random base64 of n characters has an entropy near log2(n) bits per character (n <= 64): 99% of random
    # 32-character tokens reach 0.82 of it, an English or code identifier rarely does
    return _ENTROPY.calculate_shannon_entropy(token) >= 0.82 * math.log2(min(len(token), 64))


def _random_tokens(text: str) -> Iterator[tuple[re.Match, bool]]:
    """Random-looking tokens of 32+ base64 characters, and whether each is an AWS secret access key (40
    characters, after "aws" or "secret" on its line). Not after sha256-/sha384- (subresource integrity hashes) or
    base64, (data URIs), not longer than 200 characters (encoded blobs)."""
    for m in _B64_TOKEN.finditer(text):
        token = m.group()
        if token.count("/") > 2 or _SRI.match(token) or not _random_looking(token):
            continue
        if _NOT_SECRET_BEFORE.search(text, max(0, m.start() - 8), m.start()):
            continue
        line_start = text.rfind("\n", 0, m.start()) + 1
        yield m, len(token) == 40 and _AWS_CONTEXT.search(text, max(line_start, m.start() - 60), m.start()) is not None


def _aws_secret_keys(t: _Text) -> Iterator[Span]:
    for m, aws_secret in t.random_tokens:
        if aws_secret:
            yield m.start(), m.end(), "aws_secret_key"


def _high_entropy(t: _Text) -> Iterator[Span]:
    """Any other secret of no known format."""
    for m, _ in t.random_tokens:
        yield m.start(), m.end(), "secret"


# Passwords in URLs: scheme://user:PASSWORD@host, the password up to the last @ before the host (a password may
# hold any character but whitespace, / ? #).
_URL_PASSWORD = re.compile(r"(?i)\b[a-z][a-z0-9+.\-]*://[^\s:/?#@]*:(?P<pw>[^\s/?#]+)@[^\s@/?#]+")

# Assignments to a key that names a secret: password=..., "api_key": "...", DB_PASSWORD: ..., --password=...; the
# key ends with the word (db_password, userPassword; not password_reset_url). `\_` is markdown's escaped `_`.
_U = r"(?:\\?_|-)?"
_ASSIGNMENT = re.compile(  # matched against the lowercased text: far faster than (?i)
    r"(?:(?P<pw>password|passwd|passphrase|pwd)|secret|api" + _U + "key|access" + _U + "key|secret" + _U + "key"
    r"|(?:access|auth|api|refresh|bot)" + _U + "token|client" + _U + "secret|private" + _U + "key)"
    r"(?![A-Za-z0-9])(?P<operator>[\"'\]]?[ \t]*(?::=|=>|=|:)[ \t]*)"
    r"(?:(?P<q>[\"'`])(?P<quoted>(?:(?!(?P=q))[^\n\\]|\\.){1,200})(?P=q)"
    r"|(?P<bare>[^\s\"'`,;&)}\]<>]{1,200})(?P<after>[ \t]*[^\s]?))")
# What a secret's value is not: a type, a null, a mask, a template or variable reference, or a placeholder that
# says what goes there (your-api-key, db_password, examplepassword, <token>, ...).
_NOT_A_VALUE = re.compile(
    r"(?i)[*x.\u2022]+|none|null|nil|true|false|undefined|(?:str|string|int|bool|bytes|any|object|text|varchar"
    r"|number)[!?]?|optional|required|\?")
_PLACEHOLDER = re.compile(r"(?i)pass(?:wo?r)?d|secret|your|example|here\b|api[_-]?key|token|changeme|dummy"
                          r"|redacted|placeholder|xxx|\.\.\.")
_CODE_START = tuple("$({[=%@\\&*<")
_CODE_VALUE = re.compile(r"[A-Za-z_$][\w$]*\s*[.(\[]|(?:env|os\.environ|process\.env|getenv)\b")
_NAME = re.compile(r"[A-Za-z]+(?:_[A-Za-z0-9]+)+|[A-Za-z_]+")  # access_token, API_KEY_2, matches
_CONSTANT = re.compile(r"[A-Z]+(?:_[A-Z0-9]+)+")  # 'ACCESS_KEY': the name of a setting, not its value
_SECRET_WORDS = re.compile(r"pass|pwd|secret|key|token")


def _not_a_secret(value: str) -> bool:
    return (not value.strip() or value.startswith(_CODE_START) or _NOT_A_VALUE.fullmatch(value) is not None
            or _PLACEHOLDER.search(value) is not None or _CONSTANT.fullmatch(value.replace("\\", "")) is not None)


def _passwords(t: _Text) -> Iterator[Span]:
    text = t.text
    if "://" in text:
        for m in _URL_PASSWORD.finditer(text):
            if not _not_a_secret(m.group("pw")):
                yield m.start("pw"), m.end("pw"), "password"
    lowered = text.lower()
    if len(lowered) != len(text):  # a few characters lowercase to two: then match case-insensitively
        lowered, pattern = text, re.compile(_ASSIGNMENT.pattern, re.IGNORECASE)
    else:
        pattern = _ASSIGNMENT
    if not _SECRET_WORDS.search(lowered):
        return
    for m in pattern.finditer(lowered):
        kind = "password" if m.group("pw") else "secret"
        if m.group("quoted") is not None:  # a string literal: a secret unless it is prose or a placeholder
            value = text[m.start("quoted"):m.end("quoted")]
            if " " not in value and not _not_a_secret(value):
                yield m.start("quoted"), m.end("quoted"), kind
            continue
        # an unquoted value is code more often than not: password=password, password: str, key = await f(),
        # $password = $_POST[...], api_key: API_KEY; a literal when it ends its line (YAML, .env, ini) or in a
        # tight key=value (a query string, a flag: --password=hunter2)
        value, after, operator = text[m.start("bare"):m.end("bare")], m.group("after").strip(), m.group("operator")
        if _not_a_secret(value) or _CODE_VALUE.match(value) or after[:1] in ("(", "[", ".", "="):
            continue
        if _NAME.fullmatch(value.replace("\\", "")) and (after or "_" in value):
            continue
        if after and (":" in operator and "=" not in operator or any(c in operator for c in " \t")):
            continue
        yield m.start("bare"), m.end("bare"), kind


# ------------------------------------------------------------------------------------------------ personal data

_EMAIL = re.compile(r"(?<![\w.+%-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?P<domain>[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*"
                    r"\.[A-Za-z]{2,})(?![\w-])")
_SSH_REMOTE_AFTER = re.compile(r":[\w~./-]")
_IMAGE_SCALE = re.compile(r"\d+(?:\.\d+)?x\.", re.I)  # logo@2x.png


def _emails(t: _Text) -> Iterator[Span]:
    text = t.text
    if "@" not in text:
        return
    for m in _EMAIL.finditer(text):
        if _IMAGE_SCALE.match(m.group("domain")):
            continue
        if text.startswith("git@", m.start()) and _SSH_REMOTE_AFTER.match(text, m.end()):
            continue  # git@host:org/repo.git: an SSH remote, and git is nobody
        yield m.start(), m.end(), "email"


_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: ?[A-Z0-9]{1,4}){3,9}(?![A-Za-z0-9])")


@functools.lru_cache(maxsize=None)
def _iban_length(country: str) -> int:
    """The IBAN length of a country from stdnum's IBAN registry (0: not an IBAN country)."""
    bban = iban._ibandb.info(country)[0][1].get("bban", "")
    return 4 + sum(int(n) for n in re.findall(r"\d+", bban)) if bban else 0


def _ibans(t: _Text) -> Iterator[Span]:
    text = t.text
    for start, _ in t.all_numbers:  # an IBAN's check digits start a number: DE89 3704 ..., GB82WEST1234...
        m = _IBAN.match(text, start - 2) if start >= 2 else None
        if m is None or not (length := _iban_length(m.group()[:2])):
            continue
        candidate, seen = m.group(), 0
        for end, ch in enumerate(candidate, 1):  # the prefix as long as the country's IBANs
            seen += ch != " "
            if seen == length:
                if (end == len(candidate) or candidate[end] == " ") and iban.is_valid(candidate[:end]):
                    yield m.start(), m.start() + end, "iban"
                break


_NUM_END = r"(?![\w-]|[.,:]\d)"  # not followed by more of a number, a time or a word
# grouped numbers must not be part of a longer run of groups (a row of years in a table is no card)
_CARD = re.compile(r"(?<![\w.,-])(?<!\d{4}[ -])(?:[2-6]\d{12,18}"
                   r"|[2-6]\d{3}(?P<sep>[ -])\d{4}(?:(?P=sep)\d{4}){1,2}(?:(?P=sep)\d{3})?(?!(?P=sep)\d{4})"
                   r"|3[47]\d{2}(?P<asep>[ -])\d{6}(?P=asep)\d{5}(?!(?P=asep)\d{4}))" + _NUM_END)


def _cards(t: _Text) -> Iterator[Span]:
    for m in t.matches(_CARD):
        digits = re.sub(r"\D", "", m.group())
        if 13 <= len(digits) <= 19 and luhn.is_valid(digits):
            yield m.start(), m.end(), "credit_card"


_SSN = re.compile(r"(?<![\w-])\d{3}(?P<sep>[- ])\d{2}(?P=sep)\d{4}" + _NUM_END)
_SSN_BARE = re.compile(r"(?i:ssn|social security(?: number)?)\W{1,3}(?P<bare>\d{9})" + _NUM_END)  # SSN: 536221234


def _ssns(t: _Text) -> Iterator[Span]:
    text = t.text
    for m in t.matches(_SSN):
        if ssn.is_valid(m.group()):
            yield m.start(), m.end(), "ssn"
    if "SSN" in text or "ssn" in text or "ocial" in text:
        for m in _SSN_BARE.finditer(text):
            if ssn.is_valid(m.group("bare")):
                yield m.start("bare"), m.end(), "ssn"


_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?"
                   r"(?:%[\w.]+)?(?![\w:])")


def _ipv6s(t: _Text) -> Iterator[Span]:
    text = t.text
    if "::" not in text and text.count(":") < 7:
        return
    for m in _IPV6.finditer(text):
        candidate = m.group()
        try:
            address = ipaddress.IPv6Address(candidate.split("%")[0])
        except ValueError:
            continue
        groups = [g for g in re.split(r"[:.]", candidate.split("%")[0]) if g]
        if len(groups) >= 3 and not (address.is_loopback or address.is_unspecified) \
                and any(c.isdigit() for c in candidate):  # a::b::c in C++ is no address
            yield m.start(), m.end(), "ipv6"


_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d)")
_VERSION_BEFORE = re.compile(r"(?i)(?:\b(?:version|ver\.?|release|build|v)\s*|[=<>~!^@]=?\s*)$")


def _ipv4s(t: _Text) -> Iterator[Span]:
    text = t.text
    for m in t.matches(_IPV4):
        octets = m.group().split(".")
        try:
            address = ipaddress.IPv4Address(m.group())
        except ValueError:  # an octet over 255, or a leading zero
            continue
        if address.is_loopback or address.is_unspecified or octets[0] == "255":  # netmasks and broadcast
            continue
        if all(len(o) == 1 for o in octets):  # 1.2.3.4, OpenSSL 1.1.1.1 (and 8.8.8.8, which is nobody's)
            continue
        if _VERSION_BEFORE.search(text, max(0, m.start() - 12), m.start()):
            continue
        yield m.start(), m.end(), "ipv4"


# Candidates: digit groups with single separators, an optional +CC / 00CC or (area) in front; without a country
# code the first group has two digits at least (a decimal 0.612345678 is no number), except the NANP's 1-800-...
_PHONE = re.compile(r"(?<![\w#+./\\-])(?<!\d:)(?:(?P<intl>\+|00)\d{1,3}[ .-]?(?:\(\d{1,5}\)[ .-]?)?\d{1,15}"
                    r"|(?:1[ .-])?(?:\(\d{1,5}\)[ .-]?)?\d{2,15})(?:[ .-]\d{1,15}){0,6}" + _NUM_END + r"(?!\.[A-Za-z])")
PHONE_REGIONS = ("GB", "DE", "FR", "IT", "NL", "AU", "IN", "JP", "BR")  # national numbers with a trunk 0
_IDENTIFIER_BEFORE = re.compile(r"(?i)(?:#|\b(?:order|invoice|ticket|ref|reference|no|nr|num|number|id|case|po"
                                r"|tracking|account|acct|isbn|serial|sku|item|part)\b\.?:?)\s*$")
_DATE = re.compile(r"\d{4}[-./]\d{1,2}[-./]\d{1,2}|\d{1,2}[-./]\d{1,2}[-./]\d{4}")
_RUNS = ("01234567890123456789", "98765432109876543210")  # 0123456789 is the digits, not a number
_MOBILE = phonenumbers.PhoneNumberType.MOBILE
_COUNTRY_CODE = re.compile(r"(?:\+|00)\d{1,3}[ .-]?")


def _is_phone(candidate: str, intl: bool) -> bool:
    digits = re.sub(r"\D", "", candidate)
    if not 7 <= len(digits) <= 15 or _DATE.match(candidate) or any(digits in run for run in _RUNS) \
            or re.search(r"(\d)\1{5}", digits) or not digits.strip("01"):  # 8700000000, 0101010101: codes
        return False
    national = candidate[m.end():] if intl and (m := _COUNTRY_CODE.match(candidate)) else candidate
    if "." in national and (re.search(r"[ \-]", national) or national.count(".") in (1, 3)
                            or re.search(r"\d{5}", national)):
        return False  # decimals (37.12352123, 0.446 23.397), a dotted quad: a version or an address
    try:
        if intl:
            return phonenumbers.is_valid_number(phonenumbers.parse("+" + candidate.removeprefix("+").removeprefix(
                "00"), None))
        if digits[0] == "0":  # a trunk prefix: 0 and at most 11 more digits
            return len(digits) <= 12 and any(phonenumbers.is_valid_number(phonenumbers.parse(candidate, region))
                                             for region in PHONE_REGIONS)
        if phonenumbers.is_valid_number(phonenumbers.parse(candidate, "US")):
            return True
        india = phonenumbers.parse(candidate, "IN")
        return phonenumbers.is_valid_number(india) and phonenumbers.number_type(india) == _MOBILE
    except phonenumbers.NumberParseException:
        return False


def _phones(t: _Text) -> Iterator[Span]:
    text = t.text
    for m in t.matches(_PHONE):
        if m.end() - m.start() < 7:  # fewer than 7 digits
            continue
        if _IDENTIFIER_BEFORE.search(text, max(0, m.start() - 16), m.start()):
            continue  # order #415-555-2671, ticket 4155552671: identifiers
        if _is_phone(m.group(), m.group("intl") is not None):
            yield m.start(), m.end(), "phone"


# ------------------------------------------------------------------------------------------------ scrubbing

class _Text:
    """A text being scrubbed, with what several detectors share, computed once: its numbers (the windows the
    number detectors search: one scan of the text instead of one per detector) and its random-looking tokens."""

    def __init__(self, text: str):
        self.text = text

    @functools.cached_property
    def all_numbers(self) -> list[tuple[int, int]]:
        """Runs of digits and the separators numbers are written with."""
        spans = []
        for m in _NUMBER.finditer(self.text):
            start = m.start()
            while start > 0 and self.text[start - 1] in "+(":  # +44 ..., (415) ...
                start -= 1
            spans.append((start, m.end()))
        return spans

    @functools.cached_property
    def numbers(self) -> list[tuple[int, int]]:
        """The runs that can hold a card, SSN, IPv4 or phone number: 7 characters and 4 digits at least."""
        return [(s, e) for s, e in self.all_numbers if e - s >= 7 and sum(c.isdigit() for c in self.text[s:e]) >= 4]

    def matches(self, pattern: re.Pattern) -> Iterator[re.Match]:
        """pattern's matches inside the numbers (lookbehinds see the text before; lookaheads 2 characters after)."""
        for start, end in self.numbers:
            yield from pattern.finditer(self.text, start, min(len(self.text), end + 2))

    @functools.cached_property
    def random_tokens(self) -> list[tuple[re.Match, bool]]:
        return list(_random_tokens(self.text))


_NUMBER = re.compile(r"\d[\d ().+\-]*")  # every character a card, SSN, IPv4 or phone number is written with

# Priority order: key blocks and secrets first (their bodies hold digits, dots and @), phone numbers last.
DETECTORS: tuple[Callable[[_Text], Iterator[Span]], ...] = (
    _private_keys, _bearer_tokens, _jwts, _vendor_keys, _aws_secret_keys, _passwords, _high_entropy, _emails, _ibans,
    _cards, _ssns, _ipv6s, _ipv4s, _phones)


def find(text: str) -> list[Span]:
    """Non-overlapping findings, in text order; where two overlap, the one of the earlier detector wins."""
    accepted: list[Span] = []
    starts: list[int] = []
    t = _Text(text)
    for detector in DETECTORS:
        for start, end, kind in detector(t):
            i = bisect.bisect_right(starts, start)
            if (i > 0 and accepted[i - 1][1] > start) or (i < len(accepted) and accepted[i][0] < end):
                continue
            starts.insert(i, start)
            accepted.insert(i, (start, end, kind))
    return accepted


def placeholder(kind: str) -> str:
    return f"<{kind.upper()}>"


def scrub_text(text: str, counts: Counter | None = None) -> str:
    """Replace PII and secrets with typed placeholders (<EMAIL>, <PHONE>, <JWT>, ...; see KINDS), counting the
    replacements by kind in `counts`."""
    findings = find(text)
    if not findings:
        return text
    parts, pos = [], 0
    for start, end, kind in findings:
        parts += [text[pos:start], placeholder(kind)]
        pos = end
        if counts is not None:
            counts[kind] += 1
    parts.append(text[pos:])
    return "".join(parts)
