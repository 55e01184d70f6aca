"""Published drafters as starting points (dflash_train/model/published.py): every public layout reads into the same
config and weights, the target's tensors some layouts carry are set aside, drafters whose math differs are refused
in one line, and a Hub repo id is fetched through huggingface_hub at a revision (the loopback Hub, from a subprocess
whose environment points at it, as HF_ENDPOINT must be set before huggingface_hub is imported)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny import reference_drafter

from dflash_train.errors import UserError
from dflash_train.support.hub_server import LoopbackHub
from dflash_train.model.published import fetch_drafter, read_drafter

LAYERS = [1, 3, 5]
MASK = 1000  # a reserved row past the tiny tokenizer's vocabulary


@pytest.fixture(scope="module")
def zlab(tiny_parts, tmp_path_factory) -> Path:
    return reference_drafter(tmp_path_factory.mktemp("zlab") / "drafter", tiny_parts[0], LAYERS, MASK)


def rewrite(src: Path, out: Path, config=None, extra_tensors=None, drop=()) -> Path:
    """A copy of drafter folder `src` with another config.json and tensors added or removed."""
    out.mkdir(parents=True)
    state = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if k not in drop}
    save_file({**state, **(extra_tensors or {})}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config or json.loads((src / "config.json").read_text())))
    return out


def test_a_drafter_written_by_the_reference_code_reads_with_its_weights(zlab):
    start = read_drafter(fetch_drafter(str(zlab)))
    assert start.source.layout == "z-lab" and start.set_aside == []
    c = start.config
    assert (c.target_layer_ids, c.mask_token_id, c.block_size, c.num_target_layers) == (LAYERS, MASK, 16, 8)
    reference = load_file(str(zlab / "model.safetensors"))
    assert start.state.keys() == reference.keys()
    assert all(torch.equal(start.state[k], v.float()) for k, v in reference.items())
    record = start.source.record()
    assert record["name"] == "drafter" and record["repo"] is None and "/" not in json.dumps(record["name"])
    assert len(record["weights_sha256"]["model.safetensors"]) == 64


def test_block_size_inside_dflash_config_as_the_qwen35_drafters_write_it(zlab, tmp_path):
    config = json.loads((zlab / "config.json").read_text())
    del config["block_size"]
    config["dflash_config"]["block_size"] = 8
    start = read_drafter(fetch_drafter(str(rewrite(zlab, tmp_path / "d", config))))
    assert start.config.block_size == 8 and start.source.layout == "z-lab"


def test_speculators_layout_counts_the_embedding_output_as_layer_zero(zlab, tmp_path):
    """speculators' DFlash config (its DFlashSpeculatorConfig, as its converter writes a z-lab drafter):
    transformer_layer_config, aux_hidden_state_layer_ids = z-lab ids + 1, and the verifier's tensors beside the
    drafter's. It reads to the z-lab drafter it came from."""
    zconfig = json.loads((zlab / "config.json").read_text())
    layer = {k: v for k, v in zconfig.items() if k not in ("architectures", "auto_map", "block_size", "dflash_config",
                                                           "num_target_layers")}
    config = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
              "transformer_layer_config": layer, "draft_vocab_size": layer["vocab_size"], "block_size": 16,
              "aux_hidden_state_layer_ids": [i + 1 for i in LAYERS], "mask_token_id": MASK,
              "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 15}],
                                     "verifier": {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}}}
    H, V = layer["hidden_size"], layer["vocab_size"]
    verifier = {"embed_tokens.weight": torch.randn(V, H), "verifier_norm.weight": torch.ones(H),
                "verifier_lm_head.weight": torch.randn(V, H)}
    start = read_drafter(fetch_drafter(str(rewrite(zlab, tmp_path / "s", config, verifier))))
    zlab_start = read_drafter(fetch_drafter(str(zlab)))
    assert start.source.layout == "speculators" and start.config.target_layer_ids == LAYERS
    assert start.config.num_target_layers is None  # not recorded: the target it meets decides
    assert start.set_aside == sorted(verifier)
    assert all(torch.equal(start.state[k], v) for k, v in zlab_start.state.items())


def test_a_specforge_export_reads_and_its_embedding_is_set_aside(zlab, tmp_path):
    config = json.loads((zlab / "config.json").read_text())
    config["dflash_config"]["projector_type"] = "dflash"
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    embed = {"embed_tokens.weight": torch.randn(config["vocab_size"], config["hidden_size"])}
    start = read_drafter(fetch_drafter(str(rewrite(zlab, tmp_path / "f", config, embed))))
    assert start.source.layout == "SpecForge" and start.set_aside == ["embed_tokens.weight"]


def other_math(zlab: Path, tmp_path: Path, case: str) -> Path:
    config = json.loads((zlab / "config.json").read_text())
    extra, drop = {}, ()
    if case == "dflash2":
        config["architectures"] = ["DFlash2DraftModel"]
    elif case == "domino":
        config["dflash_config"]["projector_type"] = "domino"
    elif case == "sliding":
        config["layer_types"] = ["sliding_attention", "full_attention"]
    elif case == "multiplier":
        config["dflash_config"]["output_multiplier"] = 2.0
    elif case == "reduced_vocab":
        config = {"speculators_model_type": "dflash", "transformer_layer_config": config, "draft_vocab_size": 512,
                  "aux_hidden_state_layer_ids": [2, 4, 6], "mask_token_id": MASK, "block_size": 16}
    elif case == "extra_tensor":
        extra = {"layers.0.attention_conv.weight": torch.zeros(4)}
    elif case == "missing_tensor":
        drop = ("layers.1.mlp.down_proj.weight",)
    return rewrite(zlab, tmp_path / case, config, extra, drop)


@pytest.mark.parametrize("case,message", [
    ("dflash2", r"architectures \['DFlash2DraftModel'\]: not a DFlash drafter"),
    ("domino", r"projector_type is 'domino'"),
    ("sliding", r"layer_types \['full_attention', 'sliding_attention'\]"),
    ("multiplier", r"output_multiplier 2.0"),
    ("reduced_vocab", r"a reduced draft vocabulary \(512 of the target's 1024 tokens\)"),
    ("extra_tensor", r"tensors this project's drafter does not have: layers.0.attention_conv.weight"),
    ("missing_tensor", r"missing layers.1.mlp.down_proj.weight"),
])
def test_a_drafter_with_other_math_is_refused_in_one_line(zlab, tmp_path, case, message):
    with pytest.raises(UserError, match=message) as err:
        read_drafter(fetch_drafter(str(other_math(zlab, tmp_path, case))))
    assert "\n" not in str(err.value) and case in str(err.value)  # names the folder


def test_neither_a_folder_nor_a_repo_id_is_one_line(tmp_path):
    for source in ("./no/such/folder", str(tmp_path / "missing"), "a/b/c"):
        with pytest.raises(UserError, match="neither a drafter folder on this machine nor a Hub repo id"):
            fetch_drafter(source)
    with pytest.raises(UserError, match="a revision .* names a commit of a Hub repo"):
        fetch_drafter(str(tmp_path), revision="main")


FETCH = ("import json, sys; from dflash_train.model.published import fetch_drafter, read_drafter; "
         "from dflash_train.errors import run_as_command; "
         "sys.exit(run_as_command('fetch', lambda: print(json.dumps(read_drafter(fetch_drafter(sys.argv[1], "
         "sys.argv[2] if len(sys.argv) > 2 else None)).source.record())) or 0))")
UPLOAD = ("import sys; from huggingface_hub import HfApi; api = HfApi(); api.create_repo(sys.argv[1]); "
          "print(api.upload_folder(repo_id=sys.argv[1], folder_path=sys.argv[2]).oid)")


def hub_env(hub: LoopbackHub, tmp_path: Path, offline: bool = False) -> dict[str, str]:
    return {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_test",
            "HF_HUB_OFFLINE": "1" if offline else "0", "HF_HOME": str(tmp_path / "hf_home")}


def test_a_hub_repo_id_is_fetched_at_a_revision_and_offline_reads_the_cache(zlab, tmp_path):
    with LoopbackHub(tokens={"hf_test"}) as hub:
        env = hub_env(hub, tmp_path)
        commit = subprocess.run([sys.executable, "-c", UPLOAD, "org/general", str(zlab)], env=env, text=True,
                                capture_output=True, check=True).stdout.strip()
        got = subprocess.run([sys.executable, "-c", FETCH, "org/general"], env=env, text=True, capture_output=True)
        assert got.returncode == 0, got.stderr[-2000:]
        record = json.loads(got.stdout.strip().splitlines()[-1])
        assert record["repo"] == "org/general" and record["revision"] == commit and record["layout"] == "z-lab"
        assert record["weights_sha256"] == read_drafter(fetch_drafter(str(zlab))).source.weights_sha256
        missing = subprocess.run([sys.executable, "-c", FETCH, "org/nothing"], env=env, text=True,
                                 capture_output=True)
        assert missing.returncode == 2 and missing.stderr.count("\n") == 1, missing.stderr
        assert "'org/nothing'" in missing.stderr and "could not be fetched from the Hub" in missing.stderr
    offline = subprocess.run([sys.executable, "-c", FETCH, "org/general", commit], text=True, capture_output=True,
                             env=hub_env(hub, tmp_path, offline=True))  # the server is gone: the cache answers
    assert offline.returncode == 0 and json.loads(offline.stdout.strip().splitlines()[-1])["revision"] == commit


def test_the_shipped_general_drafter_reads_and_carries_the_projects_model_code():
    """drafters/smollm2-135m-instruct-general is what push writes: this project's layout, the embedded target's
    shape, under 25 MB, and its dflash.py is the project's modeling file byte for byte (a changed model file must
    be shipped again, or the folder's remote code drifts from the math it was trained with)."""
    from conftest import REPO_ROOT

    folder = REPO_ROOT / "drafters" / "smollm2-135m-instruct-general"
    start = read_drafter(fetch_drafter(str(folder)))
    c = start.config
    assert start.source.layout == "dflash-train" and start.set_aside == []
    assert (c.hidden_size, c.vocab_size, c.num_hidden_layers, c.block_size) == (576, 49152, 3, 16)
    assert (folder / "model.safetensors").stat().st_size <= 25_000_000
    assert (folder / "dflash.py").read_bytes() == \
        (REPO_ROOT / "dflash_train" / "model" / "modeling_dflash.py").read_bytes()
