"""The compute-dtype rule: bf16 only where the hardware runs it natively, explicit choices honoured."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dflash_train.device import _cpu_flags, device_problem, native_bf16, resolve_precision
from dflash_train.errors import UserError


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
@pytest.mark.parametrize("command", ["capture", "eval"])
def test_a_device_this_machine_lacks_is_one_line_before_any_work(command, tmp_path, capsys):
    """--device bogus and --device cuda on a CPU machine ended in torch's traceback after the target had loaded."""
    from dflash_train.cli import main as cli_main

    assert device_problem(None) is None and device_problem("cpu") is None
    assert device_problem("bogus") == "is not a device (cpu, cuda or cuda:N)"
    required = {"capture": ["--prompts", "p", "--out", str(tmp_path / "o")],
                "eval": ["--drafter", "d", "--prompts", "p", "--out", str(tmp_path / "o")]}[command]
    for device, problem in (("bogus", "is not a device"), ("cuda", "no CUDA device is available here")):
        assert cli_main([command, *required, "--device", device]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"error: --device {device!r} " in err[0] and problem in err[0], err
    assert not (tmp_path / "o").exists()


def test_explicit_dtypes_are_honoured_and_unknown_ones_named():
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        precision = resolve_precision(name, "cpu")
        assert precision.dtype == dtype and precision.reason == "requested"
    with pytest.raises(UserError, match="'int8' is not one of auto, bf16, fp16, fp32"):
        resolve_precision("int8", "cpu")


def test_auto_on_this_cpu_follows_its_flags_and_the_kernels_torch_dispatches():
    precision = resolve_precision("auto", "cpu")
    native = any(f in _cpu_flags() for f in ("avx512_bf16", "amx_bf16")) and \
        torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    if sys.platform == "linux" and os.uname().machine in ("x86_64", "AMD64"):
        assert (precision.name == "bf16") is native, precision
    assert precision.reason.startswith("auto: ") and native_bf16("cpu")[0] is (precision.name == "bf16")


def test_auto_picks_fp32_under_the_avx2_emulation():
    """ATEN_CPU_CAPABILITY=avx2 makes an AVX-512 machine dispatch AVX2 kernels, where bf16 is emulated."""
    code = ("import json; from dflash_train.device import resolve_precision; "
            "p = resolve_precision('auto', 'cpu'); print(json.dumps([p.name, p.reason]))")
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    name, reason = json.loads(out.stdout.strip().splitlines()[-1])
    assert name == "fp32" and "AVX2" in reason, reason
