# The two set-up commands of the README. Both create .venv/ when missing and install the project
# (editable) with torch 2.13.0 first, so pip never pulls a CUDA build of torch: torch==2.13.0 is named
# again beside every later install, so nothing (deepspeed included) can replace it.
# The `validate` extra and torchtitan are test-only: the frameworks' own parsers check `paraplan export`.
# torchtitan goes in without its dependencies (they would bring a CUDA torch); its config parser needs
# only tyro, docstring-parser and typeguard, which the extra installs. DS_BUILD_OPS=0: no DeepSpeed kernels.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.paraplan-installed
TORCH  := torch==2.13.0
TORCHTITAN := torchtitan==0.2.2
# The code folders, byte-compiled at set-up (and again, for what changed, before the demo): an editable install
# leaves them uncompiled, and where bytecode is never written (PYTHONDONTWRITEBYTECODE) every command would
# compile its ~70 modules again first (0.2-0.3 s of each `paraplan` run on a 2-core machine).
CODE   := paraplan models hardware_specs profiler planner executor

.PHONY: demo test test-slow setup lint

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(TORCH)
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -e '.[dev,validate]' $(TORCH)
	$(PY) -m pip install --quiet --no-deps $(TORCHTITAN)
	$(PY) -m compileall -q $(CODE) >/dev/null
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m compileall -q $(CODE) >/dev/null
	$(VENV)/bin/paraplan plan

# The default suite leaves out the cases marked slow (many-rank executor runs, full-size dry runs,
# exhaustive brute-force proofs); CI (.ci/run) runs both.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .
