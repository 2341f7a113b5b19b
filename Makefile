# The two set-up commands of the README. Both create .venv/ when missing and install the project
# (editable) with torch 2.13.0 first, so pip never pulls a CUDA build of torch.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.paraplan-installed
TORCH  := torch==2.13.0

.PHONY: demo test setup lint

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/paraplan plan

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
