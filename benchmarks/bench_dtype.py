"""Capture and training throughput in bf16 and fp32, natively and under the AVX2 emulation, in one run.

    python benchmarks/bench_dtype.py [--prompts data/prompts/sharegpt]

Each cell runs `make demo`'s probe (scripts/demo_probe.py: the one-pass capture of a batch of training prompts as the
capture stage runs it, a training step of the demo recipe's shape, plain decoding at batch 1) in a fresh process, with
the compute dtype forced, natively and with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2` (PyTorch and oneDNN
then dispatch the AVX2 kernels an AVX2-only CPU has: bf16 is emulated there). The cells run in alternating order,
twice, and the faster of the two runs counts (the machine may be shared). Prints one markdown table and what `auto`
picks in each environment.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
# Run from scripts/ (`python -c` looks for modules in its working folder first), as `make demo` runs the probe
CELL = """
import json
from pathlib import Path
import demo, demo_probe
args = demo.parse_args([])
rates = demo_probe.probe(args, Path({prompts!r}), {dtype!r})
from dflash_train.device import resolve_precision
rates["auto"] = resolve_precision("auto", "cpu").describe()
print("RESULT " + json.dumps(rates))
"""


def cell(prompts: str, dtype: str, emulate: bool) -> dict:
    env = {**os.environ, **(EMULATION if emulate else {})}
    code = CELL.format(prompts=str(REPO / prompts), dtype=dtype)  # a relative --prompts is under the repo's root
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO / "scripts", capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"bench_dtype: the {dtype} cell ({'emulated' if emulate else 'native'}) failed:\n"
                         + proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default="data/prompts/sharegpt", help="an ingest folder (make ingest writes it)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    cells = [(emulate, dtype) for emulate in (False, True) for dtype in ("bf16", "fp32")]
    runs: dict[tuple[bool, str], list[dict]] = {c: [] for c in cells}
    for r in range(args.repeats):
        for emulate, dtype in (cells if r % 2 == 0 else cells[::-1]):
            got = cell(args.prompts, dtype, emulate)
            runs[(emulate, dtype)].append(got)
            print(f"run {r + 1}: {'emulated AVX2' if emulate else 'native'} {dtype}: "
                  f"{json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in got.items()})}",
                  flush=True)
    best = {c: {**rs[0], "capture_new_tok_s": max(x["capture_new_tok_s"] for x in rs),
                "capture_s_per_prompt": min(x["capture_s_per_prompt"] for x in rs),
                "decode_tok_s": max(x["decode_tok_s"] for x in rs), "train_step_s": min(x["train_step_s"] for x in rs)}
            for c, rs in runs.items()}
    print()
    print("| environment | PyTorch CPU kernels | compute dtype | capture, new tokens/s | capture, s per prompt | "
          "training step, s | plain decoding, tokens/s | `auto` picks |")
    print("|---|---|---|---|---|---|---|---|")
    for (emulate, dtype), got in best.items():
        print(f"| {'ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2' if emulate else 'native'} | "
              f"{got['cpu_capability']} | {dtype} | {got['capture_new_tok_s']:.1f} | "
              f"{got['capture_s_per_prompt']:.2f} | {got['train_step_s']:.2f} | "
              f"{got['decode_tok_s']:.1f} | {got['auto']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
