"""ingest: read production logs, normalise each request to a prompt record, dedup, scrub PII, split."""
