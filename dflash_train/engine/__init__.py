"""The serving engine in the loop: vLLM decodes our prompts, with and without a drafter, exactly as users serve.

Users run drafters in vLLM or SGLang, and a drafter that trains well can still serve at tau near 1 because of a
format detail (a config key, tapped-layer ids off by one, the block layout). So eval, the push gate and capture
at scale go through the real engine: `runner.run_engine(job)` starts vLLM in a child process
(`python -m dflash_train.engine.child JOB_DIR`) and returns what it decoded and measured.

Why a child process: vLLM's CPU build must find its environment (VLLM_TARGET_DEVICE, the KV-cache size, the
OpenMP thread binding, tcmalloc and Intel OpenMP preloaded) before it is imported; on a GPU it starts worker
processes of its own (on CPU its one worker runs in the child: `install.engine_environment`); and an engine that
dies must leave the stage able to say so in one line, with nothing half-written.

The modules, in the order a job goes through them:

- `install`: whether a vLLM that runs DFlash is installed (`check_vllm`, `vllm_version`) and the environment the
  child starts in (`engine_environment`, tcmalloc).
- `args`: the user's `--engine-args`, checked against the keys the project passes through (ENGINE_ARGS,
  `engine_args_problem`), and the `vllm serve` command line of an engine's arguments (`serve_command`).
- `jobs`: what a stage builds and reads: the job and its requests (`EngineJob`, `EngineRequest`, their
  `vllm.LLM` and `SamplingParams` arguments), the result and its outputs (`EngineResult`, `EngineOutput`,
  `ending`, `engine_steps`).
- `runner`: `run_engine` (the job to a folder, the child on it, its result back) and `engine_error` (a failed
  engine's reason, from its log).
- `child`: what runs inside the child process: the batch (capture), timed (eval's speedup protocol) and check
  modes.
- `taps`: in the child's batch mode, the target's tapped states and top-k recorded from vLLM's own forwards
  (`Recorder`), one file per request, which capture stores.

Inside vLLM, not here: `spec_decode.combined`, the package's vLLM plugin (the combined speculator: the DFlash drafter,
and prompt lookup's block where `spec_decode.lookup.CombinedRule` picks it), loaded by vLLM itself in every process.
"""
