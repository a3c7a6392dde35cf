# Two commands for a newcomer:  `make demo` (the main job)  and  `make test`.
# Both create .venv and install everything on first use.

PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch that this project is tested with; override for a GPU
# box, e.g. `make demo TORCH=torch==2.5.1`.
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python

.PHONY: install demo test test-fast coverage clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install "$(TORCH)" -e ".[test]"
	# fairseq requires torchaudio, and pip's newest (2.11) cannot load beside torch 2.13 (its library
	# links against another torch); transformers imports torchaudio whenever it is installed, so a model
	# exported with --to-hf would not load. fairseq's language models never import it: it goes.
	$(PY) -c "import torchaudio" 2>/dev/null || $(PY) -m pip uninstall --quiet --yes torchaudio
	touch $@

demo: install
	$(PY) scripts/demo.py

# Two pytest workers: most tests wait on process start-up (each fairseq
# command imports torch and fairseq afresh), so two overlap well on 2 cores;
# a third finds both cores busy. A fixed count, not -n auto: each worker's
# tests start up to 4 processes of their own. Work stealing, with the
# longest tests collected first (tests/conftest.py), ends both together. The
# 25 longest and the reasons of the skipped are listed at the end.
test: install
	$(PY) -m pytest -q -rs -n 2 --dist worksteal --durations=25

# The in-process and quick distributed tests: a few minutes.
test-fast: install
	$(PY) -m pytest -q -n 2 -m "(unit or distributed) and not slow"

# Line coverage of the package over `make test` (.coveragerc: forked ranks and
# spawned tools included); pytest-cov is installed on first use.
coverage: install
	$(PY) -m pip install --quiet pytest-cov
	$(PY) -m pytest -q -n 2 --dist worksteal --cov --cov-report=term:skip-covered

clean:
	rm -rf demo_work .pytest_cache .coverage .coverage.*
