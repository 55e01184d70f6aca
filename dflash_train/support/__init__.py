"""Support code for what runs beside the pipeline, never part of it: the scripts (scripts/), the tests, the
benchmarks (benchmarks/) and the probes (probes/) import it; no stage and no service of the package does
(tests/test_layout.py checks it).

- `runs`: what the scripts share: running a stage's command, skipping a complete stage, variants, reading metrics
  and reports into tables, plots, the machine, results.
- `measure`: timing a training step on this machine, and the demo plan's choice between stored and online states.
- `hub_server`: a loopback Hugging Face Hub for the tests and the demo's warm-start experiment.
"""
