"""Production logs, read into canonical prompt records (`dflash_train.prompts`): by ingest, which writes them to a
prompt folder, and by capture and the eval when they are given a raw log file instead of a folder.

Inputs are `.jsonl`, `.jsonl.gz`, `.json` (a top-level array, possibly cut off mid-record, or a stream of
objects) and `.parquet`; gzip is detected by its magic bytes. Every line, array element or row is one record in
one of these shapes, detected per record:

    OpenAI request log  {"request": {"messages": [...], "temperature", "top_p", "max_tokens", ...},
                         "response": {"choices": [{"message": {"content": ...}}]}}
    bare messages       {"messages": [...], "temperature"?, ..., "response"?}
    ShareGPT            {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}
    prompt only         {"prompt": "...", "response"?: "..."}

Along the data's path:
  values.py   a log file's bytes -> its record-level JSON values (or `Bad` where one cannot be decoded), counted in
              the file's `SourceStats`
  records.py  one JSON value -> its shape's messages, sampling, response, tools and constraints (`parse_record`),
              PII-scrubbed, with its prompt id: a canonical record (`iter_records`)
"""
