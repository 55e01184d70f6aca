"""evaluate: tau, speedup and losslessness, in the project's loop and in vLLM."""
