#!/usr/bin/env bash
# Installs pip and the project with its test extras into the venv whose python is $1.
# PyPI's torch brings ~3 GB of CUDA wheels; one dropped connection on one of them must not fail a
# clean-clone CI run, so each install is retried after a growing pause. Wheels fetched by an
# earlier attempt come from pip's cache, so a retry downloads only what is still missing.
set -euo pipefail
py=$1
attempts=${PRISM_INSTALL_ATTEMPTS:-5}

retry() {
  local i
  for ((i = 1; ; i++)); do
    "$@" && return 0
    if ((i >= attempts)); then
      echo "install_venv: failed $attempts times: $*" >&2
      return 1
    fi
    echo "install_venv: attempt $i of $attempts failed; retrying in $((i * 30)) s: $*" >&2
    sleep $((i * 30))
  done
}

retry "$py" -m pip install -q -U pip
retry "$py" -m pip install -q --resume-retries 10 -e '.[test]'
