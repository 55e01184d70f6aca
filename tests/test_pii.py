"""The PII and secrets scrubber: a corpus of real-looking secrets and personal data of every kind (each must
become its typed placeholder) and of look-alikes that must come out unchanged."""

import re
import time
from collections import Counter

import pytest

from dflash_train.pii import KINDS, find, scrub_text

KNOWN_CASES = [  # (text, expected, kind): the kinds the scrubber had before
    ("mail maria.lopez+bikes@mail.example.co.uk now", "mail <EMAIL> now", "email"),
    ("call (415) 555-0132 or +1 415-555-0199", "call <PHONE> or <PHONE>", "phone"),
    ("ring +44 20 7946 0958 today", "ring <PHONE> today", "phone"),
    ("card 4111 1111 1111 1111 12/25 and 5555555555554444", "card <CREDIT_CARD> 12/25 and <CREDIT_CARD>",
     "credit_card"),
    ("amex 3782-822463-10005.", "amex <CREDIT_CARD>.", "credit_card"),
    ("server 203.0.113.42:8080 and 10.1.2.3", "server <IPV4>:8080 and <IPV4>", "ipv4"),
    ("key sk-proj-4fT9xQ2mLp8ZrV6nB1cW7yK3hJ5dS0aE ok", "key <API_KEY> ok", "api_key"),
    ("token hf_QwErTyUiOpAsDfGhJkLzXcVbNm1234567890", "token <HF_TOKEN>", "hf_token"),
    ("aws AKIAIOSFODNN7EXAMPLE,", "aws <AWS_KEY>,", "aws_key"),
    ("Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2ln", "Authorization: Bearer <BEARER_TOKEN>",
     "bearer_token"),
    ("k: -----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\nAAAABG5vbmUAAAAEbm9uZQ\n"
     "-----END OPENSSH PRIVATE KEY-----\nbye", "k: <PRIVATE_KEY>\nbye", "private_key"),
    # inside a JSON string, with escaped newlines
    ('{"private_key": "-----BEGIN PRIVATE KEY-----\\nMIIEvwIBADANBgkqhkiG9w0\\nAAAABG5vbmUAAAAEbm9uZQ\\n'
     '-----END PRIVATE KEY-----\\n"}', '{"private_key": "<PRIVATE_KEY>\\n"}', "private_key"),
    ('"key": "-----BEGIN PRIVATE KEY-----\\nMIIEvwIBADANBgkqhkiG9w0\\nAAAA', '"key": "<PRIVATE_KEY>\\nAAAA',
     "private_key"),
    # a block pasted without its END line: the base64 lines go, the question stays
    ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEF\nwhat is this?", "<PRIVATE_KEY>\nwhat is this?",
     "private_key"),
]



SECRETS = [  # (text, expected) -- every kind the scrubber knows, as real traffic writes them
    # JWTs (jwt.io's example), alone and in a header that is not "Bearer"
    ("token eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4gRG9lIiwiaWF0IjoxNTE2MjM5MDIyfQ"
     ".SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c expired", "token <JWT> expired"),
    ('"ApiKey: eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhZG1pbiJ9.dBjftJeZ4CVP-mB92K27uhbUJU1p1r_wW1gFWFOEjXk"',
     '"ApiKey: <JWT>"'),
    # GitHub: classic personal, OAuth, fine-grained
    ("git push https://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@github.com/org/repo",
     "git push https://<GITHUB_TOKEN>@github.com/org/repo"),
    ("GH_TOKEN=gho_16C7e42F292c6912E7710c838347Ae178B4a", "GH_TOKEN=<GITHUB_TOKEN>"),
    ("token: github_pat_11ABCDEFG0abcdefghijkl_mnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789abcdefghijklm",
     "token: <GITHUB_TOKEN>"),
    # AWS: key id, secret access key unquoted (credentials file) and in JSON
    ("aws_access_key_id = AKIAIOSFODNN7EXAMPLE", "aws_access_key_id = <AWS_KEY>"),
    ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "aws_secret_access_key = <AWS_SECRET_KEY>"),
    ('{"AccessKeyId": "ASIAY34FZKBOKMUTVV7A", "SecretAccessKey": "je7MtGbClwBF/2Zp9Utk/h3yCo8nvbEXAMPLEKEY"}',
     '{"AccessKeyId": "<AWS_KEY>", "SecretAccessKey": "<AWS_SECRET_KEY>"}'),
    # Slack bot token and webhook, Google API key, Stripe live/restricted/test keys
    ("SLACK_BOT_TOKEN=xoxb-2631938574-4962737183729-q8Xz7RbN3mVt2LkW9pYc1sJd", "SLACK_BOT_TOKEN=<SLACK_TOKEN>"),
    ("url = 'https://hooks.slack.com/services/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'", "url = '<SLACK_TOKEN>'"),
    ("<script src=\"https://maps.googleapis.com/maps/api/js?key=AIzaSyDaGmWKa4JsXZ-HjGw7ISLn_3namBGewQe\">",
     "<script src=\"https://maps.googleapis.com/maps/api/js?key=<GOOGLE_API_KEY>\">"),
    ("stripe.api_key = sk_live_4eC39HqLyjWDarjtT1zdp7dc", "stripe.api_key = <STRIPE_KEY>"),
    ("rk_live_51H8kNpLkdIwHu7ixAbCdEfGhIjKlMnOpQrStUvWx and sk_test_51H8kNpLkdIwHu7ix0123456789abcdefghijKLMNOPqrst",
     "<STRIPE_KEY> and <STRIPE_KEY>"),
    # IBANs, spaced and compact
    ("IBAN: DE89 3704 0044 0532 0130 00, BIC COBADEFFXXX", "IBAN: <IBAN>, BIC COBADEFFXXX"),
    ("pay GB82WEST12345698765432 or FR14 2004 1010 0505 0001 3M02 606.", "pay <IBAN> or <IBAN>."),
    # IPv6
    ("ssh admin@[2001:db8:85a3::8a2e:370:7334] or fe80::1ff:fe23:4567:890a%eth0",
     "ssh admin@[<IPV6>] or <IPV6>"),
    ("host 2a00:1450:4001:82a::200e answered", "host <IPV6> answered"),
    # passwords: assignments, JSON, YAML, flags, and in URLs (host without TLD, ! and $ in the password)
    ("login with password=hunter2 please", "login with password=<PASSWORD> please"),
    ('{"username": "ana", "password": "p@ss$w0rd!"}', '{"username": "ana", "password": "<PASSWORD>"}'),
    ("DB_PASSWORD=S3cr3t!2024\nDB_HOST=db", "DB_PASSWORD=<PASSWORD>\nDB_HOST=db"),
    ("mysql -u root --password=Tr0ub4dor&3 shop", "mysql -u root --password=<PASSWORD>&3 shop"),
    ("database:\n  password: correcthorse42\n  port: 5432", "database:\n  password: <PASSWORD>\n  port: 5432"),
    ("postgres://admin:s3cret@db:5432/app", "postgres://admin:<PASSWORD>@db:5432/app"),
    ("https://bob:pa$$w0rd!@example.com/x and redis://:p4ss!word@cache:6379/0",
     "https://bob:<PASSWORD>@example.com/x and redis://:<PASSWORD>@cache:6379/0"),
    ("SECRET_KEY = 'django-insecure-8f$k2!x9@q#w'", "SECRET_KEY = '<SECRET>'"),
    # a random secret of no known format
    ("my token is Zx8Qw2Lm9Rt4Vb7Np3Kd6Hs1Jf5Gc0Ty after", "my token is <SECRET> after"),
    # phone numbers without a + country code outside the US, and a bare 10-digit US number
    ("UK office 020 7946 0958, mobile 07911 123456", "UK office <PHONE>, mobile <PHONE>"),
    ("appelle-moi au 06 12 34 56 78 ou 01.42.68.53.00", "appelle-moi au <PHONE> ou <PHONE>"),
    ("Berlin 030 12345678, Handy 0151 23456789", "Berlin <PHONE>, Handy <PHONE>"),
    ("Sydney (02) 9374 4000, Mumbai 98450 12345", "Sydney <PHONE>, Mumbai <PHONE>"),
    ("call me at 4155552671 tonight", "call me at <PHONE> tonight"),
    ("tel:+14155552671 or 0044 20 7946 0958", "tel:<PHONE> or <PHONE>"),
    # US social security numbers
    ("SSN 536-22-1234 on file", "SSN <SSN> on file"),
    ("social security number: 536221234.", "social security number: <SSN>."),
]

LOOK_ALIKES = [  # must come out unchanged
    "pin the package at 1.2.3.4",
    "built against OpenSSL 1.1.1.1 and numpy==1.24.3.1",
    "git clone git@github.com:org/repo.git && git remote add up git@gitlab.com:group/sub/project.git",
    "your order #415-555-2671 ships today; ticket 4155552671 is closed",
    "uuid 123e4567-e89b-12d3-a456-426614174000",
    "commit e83c5163316f89bfbde7d9ab23ca2e25604af290 and sha256 "
    "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
    '<script integrity="sha384-oqVuAfXRKap7fdgcCY5uykM6+R9GqQ8K/uxy9rx7HNQlGYl1kPzQho1wx4JwY8wC">',
    "docker pull python@sha256:4f8a2a58e4d6a1e2b2f3c6d8e9f0a1b2c3d4e5f60718293a4b5c6d7e8f9a0b1c",
    "dates 2023-01-15, 15/01/2023, 15.01.2023, 2023-01-15T12:30:00Z, at 12:30:45",
    "prices $1,299.99, EUR 2.499,00, 1 234 567,89 and 0.612345678",
    "math: 3.14159 * 2^10 = 3216.99, 1e-10, 10,000,000 and x = 4 * (3 + 2)",
    "std::vector<int> v; a::b::c(); MAC 00:1a:2b:3c:4d:5e; loopback ::1",
    "def login(username: str, password: str):\n    password = input('Password: ')\n    return auth(password=password)",
    "token = tokenizer(text)\napi_key = os.environ['API_KEY']\npassword = getpass.getpass()",
    "pwd : print working directory\nset password: (at least 8 characters)",
    "Unix time 1700000000, 1234567890 and the digits 0123456789",
    "logo@2x.png, @property, user@localhost, pkg@1.2.3, @babel/core",
    "class AbstractSingletonProxyFactoryBean2 extends HttpServletRequestWrapper",
    "fetch('/api/v1/users/42/orders?page=3&limit=50')",
    "ISBN 978-3-16-148410-0 and DOI 10.1000/182",
    "loopback 127.0.0.1, 0.0.0.0 and netmask 255.255.255.0",
    "pin pkg==10.1.2.3 now; SSN 000-12-3456 and 666-12-3456 were never issued",
    "-----BEGIN CERTIFICATE-----\nMIIB0zCCAX2gAwIBAgIJAO\n-----END CERTIFICATE-----",
]

LOOK_ALIKES += [
    "upgrade from 1.2.3 to 1.2.4, then firmware v10.0.1.5 and version 2.0.0.1",
    "octets out of range: 256.1.2.3 and 1.2.3.4.5 and 10.0.0",
    "order 1234 5678 9012 3456 and 4111111111111112 fail the Luhn check",
    "a table row, not a card: Year 2010 2011 2012 2013 2014 2015 2016 2017",
    "ordinary numbers: 3.14159, 10,000,000, 2023-01-15, 12:30, 1234567890, x = 42 + 17",
    "pip install scikit-learn (sk-learn), hf_hub_download(), @property, user@localhost",
    "the bearer of bad news, 127.0.0.1 and 0.0.0.0 and netmask 255.255.255.0",
    "area code rules: 123-456-7890 is not a North American number",
]




def _kinds(expected: str) -> Counter:
    return Counter(m.lower() for m in re.findall(r"<([A-Z0-9_]+)>", expected) if m.lower() in KINDS)


@pytest.mark.parametrize("text,expected", SECRETS + [(t, e) for t, e, _ in KNOWN_CASES],
                         ids=[f"{i}:" + ",".join(sorted(_kinds(e))) for i, (_, e) in
                              enumerate(SECRETS + [(t, e) for t, e, _ in KNOWN_CASES])])
def test_secrets_and_pii_become_typed_placeholders(text, expected):
    counts = Counter()
    assert scrub_text(text, counts) == expected
    assert counts == _kinds(expected)


@pytest.mark.parametrize("text", LOOK_ALIKES)
def test_look_alikes_survive_unchanged(text):
    counts = Counter()
    assert scrub_text(text, counts) == text, find(text)
    assert not counts


def test_the_corpus_covers_every_kind():
    covered = Counter()
    for _, expected in SECRETS + [(t, e) for t, e, _ in KNOWN_CASES]:
        covered.update(_kinds(expected))
    assert set(covered) == set(KINDS)


def test_bare_ten_digit_numbers_follow_the_nanp_rule():
    """A bare 10-digit number is a phone number when it is a valid North American number (or an Indian mobile);
    identifiers after # or an order word, Unix times and counting sequences are not."""
    assert scrub_text("ring 2125550147 or 9845012345") == "ring <PHONE> or <PHONE>"
    for text in ("ts 1700000000", "id 1234567890", "order 2125550147", "#2125550147", "0123456789",
                 "codes 8700000000 0101010101"):
        assert scrub_text(text) == text


def test_overlapping_findings_are_replaced_once():
    """A URL password holding an @ and a key-looking value: the earlier kind wins, nothing is replaced twice."""
    text = "Authorization: Bearer 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"
    assert scrub_text(text) == "Authorization: Bearer <BEARER_TOKEN>"
    spans = find("postgres://admin:p4ss@word!@db.example.com:5432/x mail ana@example.com")
    assert [k for _, _, k in spans] == ["password", "email"]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_scrub_is_linear_on_adversarial_text():
    start = time.perf_counter()
    for text in ("-----BEGIN PRIVATE KEY-----\n" * 5000, "a" * 200_000 + "@", "1 " * 100_000, "1." * 100_000,
                 "+1 " * 50_000, "123-" * 50_000, "(1" * 50_000, "password=" * 20_000, "Ab1" * 50_000,
                 "a:" * 100_000, "::" * 100_000, "DE12 " * 40_000, "eyJ" * 50_000, "eyJa.eyJb." * 20_000,
                 "sk-" * 50_000, "hf_" * 50_000, "xoxb-1-" * 30_000, "x://u:" * 30_000, "a://b:c@" * 30_000,
                 "AKIA" * 50_000, "github_pat_" * 20_000, "'password': '" * 20_000):
        scrub_text(text)
    assert time.perf_counter() - start < 10.0
