# What docs/gpu_*.sh share, sourced from the repository root: the settings (SHAPE, PY,
# DEADLINE: seconds for the whole call), the wheels carried as .whl installed into
# /tmp/site, and `run NAME SECONDS COMMAND...`, which writes the command's output to
# $OUT/NAME.txt with its exit status, within what is left of DEADLINE.
SHAPE=${SHAPE:-gpt2-124m}; PY=${PY:-python3}; DEADLINE=${DEADLINE:-550}
start=$SECONDS
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONUNBUFFERED=1
left() { local l=$((DEADLINE - (SECONDS - start))); [ "$l" -lt "$1" ] && echo "$l" || echo "$1"; }
run() {
  local name=$1 limit=$2; shift 2
  echo "== $name at $((SECONDS - start)) s"
  timeout "$(left "$limit")" "$@" > "$OUT/$name.txt" 2>&1; echo "rc $?" >> "$OUT/$name.txt"
}
