# Two commands for a newcomer:  `make demo` (the main job)  and  `make test`.
# Both create .venv and install everything on first use.

PYTHON ?= python3
VENV   ?= .venv
# The CPU build of torch that this project is tested with; override for a GPU
# box, e.g. `make demo TORCH=torch==2.5.1`.
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install "$(TORCH)" -e ".[test]"
	touch $@

demo: install
	$(PY) scripts/demo.py

# Two pytest workers: most tests wait on process start-up (each fairseq command
# imports torch and fairseq afresh), so two overlap well even on 2 cores
# (1042 s -> 852 s there). A third gains nothing: the two keep both cores busy
# (91% user+sys in vmstat; 1334 s with two, 1358 s with three, 2026-11-25).
# A fixed count, not -n auto: each worker's tests start up to 4 processes of
# their own.
test: install
	$(PY) -m pytest -q -n 2

clean:
	rm -rf demo_work .pytest_cache
