# make demo : run the privkit demo pipeline on the embedded data (sets up .venv on first use)
# make test : run the test suite (sets up .venv on first use)
PYTHON ?= python3
VENV   ?= .venv
# CPU build by default; GPU users: make TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH  ?= torch==2.13.0
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.privkit-installed

.PHONY: demo test venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[test,ray]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/privkit demo

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
