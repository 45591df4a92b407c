# The two commands of the README: `make lab` (students) and `make test` (everyone, CI).
# Both go through `make install`, which is idempotent: it creates .venv and installs the
# project (the `course` toolkit and the `autograder`) with every requirement in pyproject.toml.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PORT   ?= 8888

.PHONY: install lab test grade bench student-edition clean

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

# Measure the reference solutions on this machine (DDP weak scaling, ring vs all_reduce)
bench: install
	$(PY) -m autograder.bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# ---------------------------------------------------------------- instructors (docs/instructor.md)
# make release                      regenerate every assignments/<a>/ from solutions/<a>/ (nbgrader)
# make student-edition              the student edition in $(EDITION_DIR)
# make grade-folder                 grade $(SUBMISSIONS)/ into $(GRADES)/ on this machine [A=assignment]
# make gradescope                   Gradescope bundles in $(GRADESCOPE_DIR)/ [A=assignment]
# make docker-build / docker-lab    the GPU image / JupyterLab in it (docker-build-cpu, docker-lab-cpu)
# make docker-grade                 grade $(SUBMISSIONS)/ into $(GRADES)/ in the container, no network
IMAGE          ?= scale-pytorch
EDITION_DIR    ?= build/student-edition
SUBMISSIONS    ?= submissions
GRADES         ?= grades
GRADESCOPE_DIR ?= build/gradescope
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
A              ?=
COMPOSE        := COURSE_UID=$$(id -u) docker compose -f docker/compose.yaml

.PHONY: release grade-folder gradescope docker-build docker-build-cpu docker-lab docker-lab-cpu docker-grade docker-grade-cpu

release: install
	@for dir in solutions/*/; do \
	    a=$$(basename $$dir); echo "release $$a"; \
	    PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/nbgrader generate_assignment $$a --force --no-db || exit 1; \
	done

student-edition: install
	$(PY) -m autograder.edition $(EDITION_DIR) --force

grade-folder: install
	$(PY) -m autograder.batch $(SUBMISSIONS) $(GRADES) $(if $(A),--assignment $(A))

gradescope: install
	@for a in $(if $(A),$(A),$$(ls assignments)); do \
	    $(PY) -m autograder.gradescope build --assignment $$a --out $(GRADESCOPE_DIR) || exit 1; \
	done

docker-build:
	docker build -f docker/Dockerfile -t $(IMAGE):gpu --build-arg UID=$$(id -u) .

docker-build-cpu:
	docker build -f docker/Dockerfile -t $(IMAGE):cpu --build-arg UID=$$(id -u) \
	    --build-arg TORCH_INDEX=$(TORCH_CPU_INDEX) .

docker-lab:
	$(COMPOSE) up lab

docker-lab-cpu:
	$(COMPOSE) up lab-cpu

docker-grade:
	mkdir -p $(GRADES)
	SUBMISSIONS=$(abspath $(SUBMISSIONS)) GRADES=$(abspath $(GRADES)) $(COMPOSE) run --rm grade

docker-grade-cpu:
	mkdir -p $(GRADES)
	SUBMISSIONS=$(abspath $(SUBMISSIONS)) GRADES=$(abspath $(GRADES)) $(COMPOSE) run --rm grade-cpu
