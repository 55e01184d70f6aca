"""The capture store: the hidden states (or only the tokens) a capture recorded, in a few large safetensors shards
plus a manifest.json. Along the data's path:

  format.py   what writer and readers share: file names, storage dtypes, fp8 scaling, the token-only test
  writer.py   StoreWriter (resumable, shard by shard, one journal per rank) and finalize_store (the manifest)
  reader.py   open_store: the manifest and shard headers checked, a memory-mapped Store of samples
  verify.py   verify_store and check_hashes (re-hash the shards), and the `dflash-train verify` command
"""
