"""Every shipped recipe loads and validates; bad keys, types and overrides are clear errors naming key and file."""

import re
from pathlib import Path

import pytest
import yaml

from dflash_train.errors import UserError
from dflash_train.stages.train.recipe import Recipe, load_recipe

REPO = Path(__file__).resolve().parent.parent
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    monkeypatch.chdir(REPO)  # recipe paths are relative to the repo root


def test_the_shipped_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"smollm2-135m-demo.yaml", "qwen3-8b-b200x8.yaml", "qwen3.5-122b-a10b-b200x8.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_recipe_loads_and_starts_with_its_command(path):
    recipe = load_recipe(path)
    assert isinstance(recipe, Recipe)
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and "train.py" in first and f"recipes/{path.name}" in first
    assert Path(recipe.train.deepspeed).is_file()
    # the public block, except where a CPU engine serves the drafter: it verifies 1 + K slots, K 4-6 there
    assert recipe.drafter.block_size == (8 if path.name == "smollm2-135m-adapt.yaml" else 16)
    assert recipe.optimizer.weight_decay == 0.0
    assert recipe.optimizer.warmup_ratio == 0.04 and recipe.optimizer.grad_clip == 1.0


def test_the_demo_recipe_uses_the_combination_the_ablation_chose():
    """recipes/smollm2-135m-demo.yaml = the public settings plus exactly the ablation's chosen levers, and a draft
    vocabulary (measured apart; the ablation drafts the whole vocabulary, as the public recipe does)."""
    import ablate_sample_efficiency as ablate

    from dflash_train.support import runs

    demo = load_recipe(REPO / "recipes" / "smollm2-135m-demo.yaml")
    assert demo.drafter.draft_vocab_size is not None
    rebuilt = load_recipe(REPO / "recipes" / "smollm2-135m-demo.yaml",
                          [*runs.split_overrides(ablate.PUBLIC), *runs.split_overrides(ablate.CHOSEN),
                           f"drafter.draft_vocab_size={demo.drafter.draft_vocab_size}"])
    assert demo.to_dict() == rebuilt.to_dict()
    assert demo.drafter.init == "target" and demo.objective.context_warmup_ratio > 0
    assert demo.decay_gamma == 3.0 and (demo.train.micro_batch_size, demo.objective.num_anchors) == (2, 32)


@pytest.mark.parametrize("name", ["qwen3-8b-b200x8.yaml", "qwen3.5-122b-a10b-b200x8.yaml",
                                  "qwen3-8b-online-b200x8.yaml"])
def test_production_recipes_follow_the_dflash_literature(name):
    r = load_recipe(REPO / "recipes" / name)
    assert (r.drafter.num_layers, r.objective.num_anchors, r.train.epochs, r.data.max_length) == (5, 512, 6, 3072)
    assert r.optimizer.lr == 6e-4 and r.optimizer.schedule == "cosine" and r.drafter.init == "random"
    assert r.decay_gamma == 7.0
    assert r.data.replay_stores == [] and r.data.replay_samples is None  # no replay: data.stores alone train
    assert r.train.precision == "auto" and r.train.deepspeed.endswith("zero2.json")


def test_the_online_recipe_is_the_stored_one_with_its_states_computed():
    stored = load_recipe(REPO / "recipes" / "qwen3-8b-b200x8.yaml").to_dict()
    online = load_recipe(REPO / "recipes" / "qwen3-8b-online-b200x8.yaml").to_dict()
    assert online["data"].pop("hidden_states") == "online" and stored["data"].pop("hidden_states") == "stored"
    assert online["data"].pop("stores") == ["data/store/qwen3-8b-tokens"]
    stored["data"].pop("stores")
    for key in ("name", "output_dir"):
        assert online.pop(key) != stored.pop(key)
    assert online == stored


def test_accelerate_and_deepspeed_configs_parse():
    for path in (REPO / "recipes" / "accelerate").glob("*.yaml"):
        cfg = yaml.safe_load(path.read_text())
        assert cfg["distributed_type"] == "MULTI_GPU" and cfg["num_processes"] >= 2
    import json

    for stage, name in ((2, "zero2.json"), (3, "zero3.json")):
        cfg = json.loads((REPO / "recipes" / "deepspeed" / name).read_text())
        assert cfg["zero_optimization"]["stage"] == stage


def _write(tmp_path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, message", [
    ("data: {stores: [s]}\nobjective: {num_anchor: 64}\n", r"unknown key 'objective.num_anchor'"),
    ("data: {stores: [s]}\nlearning_rate: 1\n", r"unknown key 'learning_rate'"),
    ("data: {stores: [s]}\nobjective: {num_anchors: many}\n", r"key 'objective.num_anchors' must be int"),
    ("data: {stores: [s]}\nobjective: {num_anchors: 6.5}\n", r"key 'objective.num_anchors' must be int"),
    ("data: {stores: [s]}\ntrain: {gradient_checkpointing: 'yes'}\n", r"'train.gradient_checkpointing' must be bool"),
    ("data: {stores: s}\n", r"key 'data.stores' must be list of str"),
    ("data: {stores: [s, 3]}\n", r"key 'data.stores\[1\]' must be str"),
    ("data: {stores: [s]}\ntrain: {precision: fp16}\n", r"'train.precision' must be 'auto' \| 'bf16' \| 'fp32'"),
    ("data: {stores: [s]}\noptimizer: 3\n", r"'optimizer' must be a mapping"),
    ("data: {stores: []}\n", r"key 'data.stores' must list at least one"),
    ("data: {stores: [s], replay_samples: -1}\n", r"key 'data.replay_samples' must be >= 0, got -1"),
    ("data: {stores: [s], replay_stores: [r, ./s]}\n", r"key 'data.replay_stores' must list each store once and "
                                                       r"none of data.stores"),
    ("data: {stores: [s], eval_store: e, replay_stores: [r, r]}\n", r"key 'data.replay_stores' must list each"),
    ("data: {stores: [s], eval_store: e, replay_stores: [e]}\n", r"key 'data.replay_stores' .*data.eval_store"),
    ("data: {stores: [s]}\noptimizer: {warmup_ratio: 1.5}\n", r"'optimizer.warmup_ratio' must be in \[0, 1\)"),
    ("data: {stores: [s]}\ntrain: {deepspeed: nowhere.json}\n", r"'train.deepspeed' names nowhere.json"),
    ("- a\n- b\n", r"top level must be a mapping"),
    ("data: [\n", r"not valid YAML"),
    ("name: x\ndata: [unclosed\n  foo: :\n",  # PyYAML's own message spans lines: one line, where it is
     r"not valid YAML: expected ',' or '\]', but got ':' \(line 3, column 6\)$"),
])
def test_validation_errors_name_the_key_and_the_file(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(UserError, match=message) as err:
        load_recipe(path)
    assert str(path) in str(err.value)


def test_overrides_are_typed_dotted_and_validated(tmp_path):
    path = _write(tmp_path, "data: {stores: [s]}\n")
    r = load_recipe(path, ["objective.num_anchors=64", "optimizer.lr=1e-3", "train.max_steps=10",
                           "drafter.target_layer_ids=[1, 3, 5]", "data.eval_store=null", "push.min_tau=2.5"])
    assert r.objective.num_anchors == 64 and r.optimizer.lr == 1e-3 and r.train.max_steps == 10
    assert r.drafter.target_layer_ids == [1, 3, 5] and r.data.eval_store is None and r.push.min_tau == 2.5
    with pytest.raises(UserError, match=r"unknown key 'objective.anchors'"):
        load_recipe(path, ["objective.anchors=3"])
    with pytest.raises(UserError, match=r"'train.max_steps' must be int \| null, got 'ten'"):
        load_recipe(path, ["train.max_steps=ten"])
    with pytest.raises(UserError, match="not of the form key=value"):
        load_recipe(path, ["train.max_steps"])
    with pytest.raises(UserError, match=r"the value is not valid YAML: .* \(line 1, column 3\)$"):
        load_recipe(path, ["train.max_steps=[1"])
    with pytest.raises(UserError, match=r"key 'seed' must be int"):
        load_recipe(path, ["seed.x=1"])
    with pytest.raises(UserError, match=r"'seed' is not a section"):
        load_recipe(_write(tmp_path, "seed: 0\ndata: {stores: [s]}\n"), ["seed.x=1"])


def test_a_recipe_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_bytes(b"name: \xff\xfe\n")
    with pytest.raises(UserError, match=r"r.yaml is not UTF-8 text \(byte 6\)$"):
        load_recipe(path)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")


def test_defaults_are_the_dflash_recipe():
    from dflash_train.stages.train.drafter import NEW_DRAFTER_LAYERS

    r = Recipe()
    assert r.drafter.num_layers is None and NEW_DRAFTER_LAYERS == 5  # unset: a new drafter has 5 layers
    assert (r.objective.num_anchors, r.drafter.block_size) == (512, 16)
    assert (r.optimizer.lr, r.optimizer.weight_decay, r.optimizer.warmup_ratio, r.optimizer.grad_clip) == (
        6e-4, 0.0, 0.04, 1.0)
    assert r.optimizer.schedule == "cosine" and r.train.precision == "auto"
    assert r.train.deepspeed == "recipes/deepspeed/zero2.json" and r.checkpoint.resume == "auto"
    assert r.decay_gamma == 7.0


@pytest.mark.parametrize("text, override, key", [
    ("optimizer: {lr: .inf}\n", None, "optimizer.lr"),
    ("optimizer: {lr: .nan}\n", None, "optimizer.lr"),
    ("", "optimizer.lr=.inf", "optimizer.lr"),
    ("", "optimizer.grad_clip=nan", "optimizer.grad_clip"),
    ("", "optimizer.betas=[0.9, .nan]", "optimizer.betas[1]"),
    ("", "train.time_budget_s=inf", "train.time_budget_s"),
])
def test_non_finite_recipe_values_are_refused_at_load(tmp_path, text, override, key):
    """lr .inf used to pass validation and export an all-NaN drafter; every float of a recipe must be finite."""
    path = _write(tmp_path, "data: {stores: [s]}\n" + text)
    with pytest.raises(UserError, match=rf"key '{re.escape(key)}' must be a finite number") as err:
        load_recipe(path, [override] if override else [])
    assert str(path) in str(err.value)
