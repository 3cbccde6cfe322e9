#!/usr/bin/env bash
# One H200 lease, step by step (each device call carries < 64 MiB and /tmp lasts while the machine is warm).
#   bash benchmarks/leases/plans/real_run_2_setup.sh stash DIR...   copy carried folders to /tmp/c (they vanish next call)
#   bash benchmarks/leases/plans/real_run_2_setup.sh setup          install carried wheels + this repo, rebuild the GGUF,
#                                                 export the target as an HF bf16 folder (/tmp/smol-hf)
#   bash benchmarks/leases/plans/real_run_2_setup.sh sglang         install the SGLang 0.5.17 wheel set into /tmp/sgl
#   source benchmarks/leases/plans/real_run_2_setup.sh env          the environment the other scripts run under
# Carry layout (.carry/, ignored): p1 = GGUF part aa + deps wheels; p2 = GGUF part ab + prompt data (sharegpt-3000.json,
# MT-Bench, benchmarks/domain_sets.py's files; the big JSON files gzipped, unpacked by setup);
# sglang/part1, sglang/part2 = the wheel set of ../shared/sglang-h200/build-wheelset.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
C=/tmp/c
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
session_env() {
  export PYTHONPATH=/tmp/deps:/tmp/eagle3ft-site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
  export SGL_DIR=/tmp/sgl PYTHON=python3 MODEL=/tmp/smol-hf DATA=$C/p2/data
}
case ${1:-} in
  stash)
    shift; mkdir -p $C
    for d in "$@"; do  # whole or not at all: a background job may be waiting for it
      dest=$C/${d#.carry/}
      mkdir -p "$(dirname "$dest")" && rm -rf "$dest.partial" && cp -r "$d" "$dest.partial" && rm -rf "$dest" && mv "$dest.partial" "$dest"
    done
    du -sh $C/* ;;
  setup)
    session_env
    for f in "$C"/p2/data/*.gz; do [[ -e $f ]] && python3 -m gzip -d "$f" && rm "$f"; done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/deps $C/p1/deps/*.whl
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/eagle3ft-site . >/dev/null
    mkdir -p /tmp/gguf && cat $C/p1/smol.gguf.part-aa $C/p2/smol.gguf.part-ab > /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
    echo "$GGUF_SHA256  /tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c -
    [[ -f /tmp/smol-hf/config.json ]] || python3 benchmarks/sglang_target.py export-hf --config configs/smollm2-135m.yaml \
      --set target.path=/tmp/gguf/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/smol-hf ;;
  sglang)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sgl $C/sglang/part1/*.whl $C/sglang/part2/*.whl
    mkdir -p /tmp/sgl/deep_gemm && cp ../shared/sglang-h200/deep_gemm_stub.py /tmp/sgl/deep_gemm/__init__.py 2>/dev/null \
      || printf '%s\n' 'def __getattr__(name):' '    def _missing(*a, **k):' '        raise RuntimeError(f"deep_gemm.{name} is not installed")' '    return _missing' > /tmp/sgl/deep_gemm/__init__.py
    PYTHONPATH=/tmp/sgl python3 -c "import sglang; print('sglang', sglang.__version__)"
    touch /tmp/sgl/.ready ;;
  env) session_env ;;
  *) echo "usage: $0 stash DIR... | setup | sglang | env" >&2; exit 2 ;;
esac
