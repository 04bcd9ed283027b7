# Source from the repository root on a GPU machine without rlcore's dependencies:
#   . bench/device_env.sh
# installs the wheels in .whl/ (rlcore's own wheel among them: `pip wheel --no-deps . -w .whl`)
# into /tmp/site, puts it on PYTHONPATH, and records the commit for the results files.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export RLCORE_BENCH_COMMIT=${RLCORE_BENCH_COMMIT:-$(cat .whl/COMMIT 2>/dev/null)}
python3 -c "import rlcore, omegaconf, stevedore, pluggy, pynvml, datasets; print('rlcore at', rlcore.__file__)"
