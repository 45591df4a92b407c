#!/usr/bin/env bash
# Entry point of the course image (docker/Dockerfile). One image, three uses:
#
#   lab [JUPYTER_ARGS...]          JupyterLab for students on 0.0.0.0:$PORT (default 8888),
#                                  rooted at $COURSE_WORK (default ~/work)
#   grade [SUBMISSIONS [GRADES]]   grade every notebook in SUBMISSIONS (default /submissions)
#                                  into GRADES (default /grades): grades.csv + per-student
#                                  results (python -m autograder grade-folder; env ASSIGNMENT,
#                                  GRADE_TIMEOUT, GRADE_JOBS, GRADE_SHARD=K/N)
#   anything else                  run as a command: bash, python -m autograder grade NB, ...
#
# It also runs on a host (tests/test_docker.py does): COURSE_HOME (the repository, default: the
# folder above this script) and PYTHON (default: python3) say where things are.
set -euo pipefail

COURSE_HOME="${COURSE_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
PYTHON="${PYTHON:-python3}"

die() {
    echo "entrypoint: $*" >&2
    exit 2
}

# The image runs as any uid (compose and the docs pass --user "$(id -u):$(id -g)", root
# included), so the uid may have no home and no name. Jupyter and matplotlib write under $HOME;
# getpass.getuser() (Jupyter, torch's caches) reads $USER before the password database.
if [ -z "${HOME:-}" ] || [ "${HOME}" = / ] || [ ! -w "${HOME}" ]; then
    export HOME="/tmp/home-$(id -u)"
    mkdir -p "$HOME"
fi
export USER="${USER:-$(id -un 2>/dev/null || echo "uid$(id -u)")}"

# A fresh work folder gets the lessons and the released assignments. Files already there are
# never overwritten; a mounted clone of the repository (it has pyproject.toml) and a work folder
# made on the host by make lab or make docker-work (.release.json, its record) are left as is.
seed_work() {
    local work="$1" part
    mkdir -p "$work"
    [ -e "$work/pyproject.toml" ] || [ -e "$work/.release.json" ] && return 0
    for part in course/lessons course/scripts assignments; do
        if [ -d "$COURSE_HOME/$part" ]; then
            "$PYTHON" - "$COURSE_HOME/$part" "$work/$part" <<'PY'
import os, shutil, sys

def copy_if_missing(src, dst):  # cp -n's exit status differs between coreutils versions
    if not os.path.lexists(dst):
        shutil.copy2(src, dst)

shutil.copytree(sys.argv[1], sys.argv[2], dirs_exist_ok=True, copy_function=copy_if_missing,
                ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
PY
        fi
    done
}

mode="${1:-lab}"
[ "$#" -gt 0 ] && shift

case "$mode" in
    lab)
        work="${COURSE_WORK:-$HOME/work}"
        seed_work "$work"
        cd "$work"
        root_args=()
        # Root in the container is the host's root (a cloud instance's usual login): its files.
        [ "$(id -u)" -eq 0 ] && root_args=(--allow-root)
        exec jupyter lab --ip 0.0.0.0 --no-browser --port "${PORT:-8888}" \
            --ServerApp.root_dir="$work" "${root_args[@]}" "$@"
        ;;
    grade)
        submissions="${1:-${SUBMISSIONS_DIR:-/submissions}}"
        grades="${2:-${GRADES_DIR:-/grades}}"
        [ -d "$submissions" ] || die "no submissions folder at $submissions (mount one there)"
        mkdir -p "$grades" 2>/dev/null || true
        [ -w "$grades" ] || die "cannot write to $grades: create it on the host first, writable by uid $(id -u)"
        args=("$submissions" "$grades")
        if [ -n "${ASSIGNMENT:-}" ]; then
            args+=(--assignment "$ASSIGNMENT")
        fi
        if [ -n "${GRADE_TIMEOUT:-}" ]; then
            args+=(--timeout "$GRADE_TIMEOUT")
        fi
        if [ -n "${GRADE_JOBS:-}" ]; then      # notebooks at once (default: what the machine holds)
            args+=(--jobs "$GRADE_JOBS")
        fi
        if [ -n "${GRADE_SHARD:-}" ]; then     # K/N: one slice of the class (merge joins them)
            args+=(--shard "$GRADE_SHARD")
        fi
        cd "$COURSE_HOME"
        exec "$PYTHON" -m autograder grade-folder "${args[@]}"
        ;;
    *)
        exec "$mode" "$@"
        ;;
esac
