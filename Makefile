# make demo : run the privkit demo pipeline on the embedded data (sets up .venv on first use)
# make test : run the test suite (sets up .venv on first use)
# make docs : build the documentation site into site/ (warnings are errors)
# make lint : ruff (rules and formatting) on the whole tree, mypy on the libraries and privkit
PYTHON ?= python3
VENV   ?= .venv
# torch from the configured package index. PyPI's Linux wheel bundles CUDA (several GB to download);
# the CPU-only wheel is much smaller: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
# GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
BASE    = $(VENV)/.privkit-base-installed
STAMP   = $(VENV)/.privkit-installed

.PHONY: demo test docs lint venv clean

# the demo needs privkit alone; tests add pytest, the optional ray executor and Flower.
# --no-compile: pip would byte-compile every file it installs (20 s, mostly torch modules no run
# imports); privkit.precompile compiles what a run imports (10 s), the test setup the rest.
SITE    = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

$(BASE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile $(TORCH)
	$(PY) -m pip install --quiet --no-compile -e .
	$(PY) -m privkit.precompile
	touch $(BASE)

$(STAMP): $(BASE)
	$(PY) -m pip install --quiet -e ".[test,ray,flower,docs,lint]"
	$(PY) -m compileall -q -j 0 $(SITE) > /dev/null || true  # a few packages ship test files of other Python versions
	touch $(STAMP)

venv: $(STAMP)

demo: $(BASE)
	$(VENV)/bin/privkit demo

# the test files spread over TEST_WORKERS processes (one torch thread each; most of the suite's
# slow tests wait on a privkit subprocess): make test TEST_WORKERS=0 runs them in this process
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache site
