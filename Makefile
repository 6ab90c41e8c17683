# Every target builds .venv from the project's own files first; installing twice is a no-op.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export TMPDIR := $(CURDIR)/.tmp
export TORCHINDUCTOR_CACHE_DIR := $(CURDIR)/.tmp/inductor
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install oracles demo test test-fast bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	@mkdir -p $(TMPDIR)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU wheel; an unpinned torch would pull CUDA packages.
	$(PY) -m pip install --quiet torch==2.13.0 "numpy<2"
	$(PY) -m pip install --quiet -e ".[torch,mindspore,dev]"
	touch $(STAMP)

# Peer packages used as test oracles (shared/reference/oracles.md), installed beside .venv:
# their pins fight ours, so --no-deps and a separate target directory put on PYTHONPATH
# only by the tests that need it. numpy<2 for MindSpore hence pandas<2.3, pyarrow<19; the peers
# pinned to the versions the oracle tests were written against.
ORACLES      := .oracles
ORACLE_STAMP := $(ORACLES)/.installed
ORACLE_PKGS  := megatron-core==0.16.1 torchtitan==0.3.0 mindformers==2.1.0 deepspeed==0.19.8 torchft==0.2.0 \
	tyro spmd-types docstring_parser einops hjson deprecated wrapt msgpack requests urllib3 \
	certifi jieba rouge_chinese "datasets==2.21.0" multiprocess "pandas<2.3" python-dateutil \
	pytz tzdata "pyarrow<19" aiohttp multidict attrs yarl propcache aiosignal frozenlist \
	aiohappyeyeballs xxhash sentencepiece tiktoken mindpet tensorboardX triton==3.9.0 torchdata==0.11.0 \
	tensorboard==2.21.0 absl-py==2.5.1 typeguard==4.6.0

oracles: $(ORACLE_STAMP)

$(ORACLE_STAMP): | $(STAMP)
	rm -rf $(ORACLES)
	$(VENV)/bin/pip install --quiet --no-deps --target $(ORACLES) $(ORACLE_PKGS)
	touch $(ORACLE_STAMP)

demo: install
	$(PY) -m ms_llm demo

# Tests run in parallel, one file to a worker at a time so that module fixtures run once
# (pytest-xdist; tests/conftest.py hands out the longest files first). The multi-process tests
# wait much of their time on launchers, rendezvous and MindSpore's cluster start, so more
# workers than cores keeps the cores busy.
TEST_WORKERS ?= 4
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install oracles
	$(PYTEST) tests

test-fast: install oracles
	$(PYTEST) -m "not slow" tests

# Every bench/ script (bench/_*.py are helpers), each one's output appended to the results file under
# the machine and the date; the file replaces bench/results/latest.md only when every bench ran.
BENCH_RESULTS := bench/results/latest.md
bench: install oracles
	@mkdir -p $(dir $(BENCH_RESULTS))
	@printf '# Benchmark results\n\nWritten by `make bench`: each section is one bench/ script run on this machine, its ratios measured side by side in one run.\n\n' > $(BENCH_RESULTS).tmp
	@for b in bench/[!_]*.py; do echo "== $$b"; $(PY) bench/_results.py $(BENCH_RESULTS).tmp $$b || exit 1; done
	@mv $(BENCH_RESULTS).tmp $(BENCH_RESULTS)
	@echo "wrote $(BENCH_RESULTS)"

clean:
	rm -rf .tmp runs build *.egg-info
