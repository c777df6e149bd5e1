#!/usr/bin/env bash
# Wheels benchmarks/gpu.py needs on a GPU machine that cannot download (Python 3.12, x86-64), into
# .whl/ (git-ignored): what finetune needs beyond torch/transformers/peft/accelerate/triton, and
# the peers trl and liger-kernel. ~47 MB. The versions are the ones this repo is tested with.
#
#   bash benchmarks/gpu_wheels.sh            # here, where pip reaches the registry
#   # there, in the repo root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site; python3 -m pip install -q --no-deps --no-build-isolation -e .
#
# unsloth is not here: with its own dependencies it is far larger than one transfer (64 MiB).
# datasets 5.2 needs pyarrow >= 24: check `python3 -m pip show pyarrow` there first.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
for pkg in bitsandbytes==0.50.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 pydantic==2.14.3 \
    pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 trl==1.16.0 liger-kernel==0.8.5 peft==0.21.2; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl "$pkg"
done
# datasets 5.2 needs pyarrow >= 24; gpu_session.sh installs this one instead on an older pyarrow
mkdir -p .whl/alt
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl/alt datasets==4.4.2
du -sh .whl
