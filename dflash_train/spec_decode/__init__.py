"""The speculators, one a module, as vLLM keeps its own (`vllm/v1/spec_decode/`): what drafts the tokens a target
verifies.

- `loop`: the project's speculative-decoding loop (a block drafter's steps, and the plain decoding it reproduces).
- `lookup`: prompt lookup's rule (vLLM's n-gram speculator) and the combined speculator's rule (`CombinedRule`).
- `suffix`: the suffix tree (arctic-inference's, vLLM's `suffix` speculator) as a source of drafts.
- `combined`: the combined speculator in vLLM, the package's `vllm.general_plugins` plugin (the DFlash drafter, the
  suffix tree's and prompt lookup's blocks where the rule picks them).

Services the stages and the engine stand on: they import nothing from `dflash_train.engine` or a stage. Nothing is
imported here, so vLLM loading the plugin in every process, or a reader of the rules, pays for no other module.
"""
