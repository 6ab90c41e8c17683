# Every target builds .venv from the project's own files first; installing twice is a no-op.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export TMPDIR := $(CURDIR)/.tmp
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.tmp/inductor
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install demo test test-fast bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@mkdir -p $(TMPDIR)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel; an unpinned torch would pull CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0 "numpy<2"
	$(PY) -m pip install --quiet -e ".[torch,mindspore,dev]"
	touch $(STAMP)

demo: install
	$(PY) -m ms_llm demo

test: install
	$(PY) -m pytest -q tests

test-fast: install
	$(PY) -m pytest -q -m "not slow" tests

bench: install
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf .tmp runs build *.egg-info
