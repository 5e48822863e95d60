#!/usr/bin/env bash
# Idempotent install of everything the project needs: nginx and postgresql from Debian (the
# load-balancer test; the shared job store's tests start a throwaway PostgreSQL with its initdb and
# pg_ctl, which Debian 12 and 13 keep in /usr/lib/postgresql/<version>/bin), and into .venv the
# pinned Python packages (requirements.txt) and a working perf_analyzer.
# Reruns are a no-op unless requirements.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP="$VENV/.installed-$(sha256sum requirements.txt | cut -c1-16)"

MISSING=()
if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then MISSING+=(nginx); fi
if ! command -v pg_ctl >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
  MISSING+=(postgresql)
fi
if [ ${#MISSING[@]} -gt 0 ]; then
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get install -y -q "${MISSING[@]}" >/dev/null 2>&1 ||
    { $SUDO apt-get update -q && $SUDO apt-get install -y -q "${MISSING[@]}"; }
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
if [ ! -f "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -r requirements.txt
  "$VENV/bin/python" -m pip install -q --no-deps -e .
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi

# perf_analyzer from the tritonclient wheel needs libb64.so.0d and libcudart.so.12.
# Both ship inside the nvidia-pytriton wheel; link them under their sonames so no
# system package is needed (works the same on Debian 12 and 13).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LIBS="$SITE/nvidia_pytriton.libs"
PA_LIBS="$VENV/lib/perf_analyzer_libs"
mkdir -p "$PA_LIBS"
ln -sf "$(ls "$LIBS"/libb64-*.so.0d | head -n1)" "$PA_LIBS/libb64.so.0d"
ln -sf "$(ls "$LIBS"/libcudart-*.so.12* | head -n1)" "$PA_LIBS/libcudart.so.12"
cat > "$VENV/bin/perf_analyzer_local" <<WRAP
#!/usr/bin/env bash
# perf_analyzer with the libraries it needs on this machine.
export LD_LIBRARY_PATH="$PWD/$PA_LIBS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$PWD/$VENV/bin/perf_analyzer" "\$@"
WRAP
chmod +x "$VENV/bin/perf_analyzer_local"
"$VENV/bin/perf_analyzer_local" --version >/dev/null 2>&1 || { echo "setup: perf_analyzer does not run" >&2; exit 1; }
echo "setup: .venv ready"
