# The two commands of the README: `make lab` (students) and `make test` (everyone, CI).
# Both go through `make install`, which is idempotent: it creates .venv and installs the
# project (the `course` toolkit and the `autograder`) with every requirement in pyproject.toml.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 8888

.PHONY: install lab test grade student-edition clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (workshop)" >/dev/null
	touch $(STAMP)

lab: install
	$(VENV)/bin/jupyter lab --ServerApp.root_dir=. --port=$(PORT) $(LAB_ARGS)

# pytest exits 5 when it collects nothing; that is not a failure of the suite, every other
# non-zero code is.
test: install
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

# Grade one notebook: make grade NB=path/to/notebook.ipynb
grade: install
	$(PY) -m autograder grade $(NB)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
