import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

# Tiny models run faster on one thread; `make test` runs one worker per core (pytest-xdist) to use the others.
torch.set_num_threads(1)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_parts(tiny_target_dir):
    """(transformers config, tokenizer) of the tiny target."""
    from transformers import AutoConfig, AutoTokenizer

    return AutoConfig.from_pretrained(tiny_target_dir), AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A random tiny Llama target with tokenizer and chat template (hidden 64, 8 layers, vocab 1024)."""
    from tiny import make_tiny_target

    return make_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from dflash_train.target import load_target

    return load_target(str(tiny_target_dir), dtype=__import__("torch").float32)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded target (converted once into the user's cache, then loaded in ~1 s)."""
    from dflash_train.target import load_target

    return load_target("smollm2-135m-instruct")


def default_sigint() -> None:
    """`preexec_fn` of a subprocess a test interrupts as Ctrl-C does: SIGINT back to its default action, whatever
    this process inherited (a shell's background job, `cmd &`, ignores SIGINT, and so would the command, which then
    never sees the interrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
