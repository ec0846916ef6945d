# Set up the GPU machine to run impala-rl from this checkout, offline. Source it from the
# repository root (bash):
#
#     source scripts/device_setup.sh && python3 benchmarks/gpu_box.py --out "$OUT/gpu-box.json"
#
# The machine has Python 3.12 with torch (CUDA), tensorboard, rich, numpy and opencv, but not
# the rest of impala-rl's dependencies. Their cp312 wheels are in .whl/ (git-ignored: carry it
# to the machine), downloaded here with
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#         --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#         --platform manylinux2014_x86_64 -d .whl gymnasium==1.4.0 ale-py==0.12.1 \
#         omegaconf==2.4.0 pyyaml==6.0.4 cloudpickle==3.1.3 farama-notifications==0.0.6 \
#         typing_extensions==4.16.0 pytest pluggy iniconfig packaging
#
# (omegaconf 2.4 vendors its antlr4 runtime; matplotlib is imported only by `impala plot`.)
# This installs them without dependencies into $IMPALA_SITE (default /tmp/site), puts it and
# src/ on PYTHONPATH (the project is not installed: `python3 -m impala_rl.cli` is `impala`, and
# a shell function `impala` is defined) and prints the versions it will run with. Sourced, it
# never exits the calling shell; it returns non-zero when something is missing.

_impala_setup() {
    local root python site wheels
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    python="${PYTHON:-python3}"
    site="${IMPALA_SITE:-/tmp/site}"
    wheels=("$root"/.whl/*.whl)
    if [ ! -e "${wheels[0]}" ]; then
        echo "device_setup: no wheels in $root/.whl (carry .whl to this machine)" >&2
        return 1
    fi
    if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
        echo "device_setup: $python is not Python 3.12; the wheels in .whl are cp312" >&2
        return 1
    fi
    mkdir -p "$site" || return 1
    PIP_ROOT_USER_ACTION=ignore "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --disable-pip-version-check --target "$site" "${wheels[@]}" || return 1
    case ":${PYTHONPATH:-}:" in
        *":$site:$root/src:"*) ;;
        *) export PYTHONPATH="$site:$root/src${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
    case ":$PATH:" in
        *":$site/bin:"*) ;;
        *) export PATH="$site/bin:$PATH" ;;
    esac
    export IMPALA_PYTHON="$python"
    "$python" - <<'EOF' || return 1
import importlib, os, platform, sys

print(f"python {platform.python_version()} ({sys.executable}), {os.cpu_count()} cores")
missing = []
for name in ("torch", "numpy", "gymnasium", "ale_py", "omegaconf", "yaml", "cloudpickle",
             "rich", "tensorboard", "cv2", "impala_rl"):
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # report every missing one, then fail
        missing.append(name)
        print(f"  {name:<12} MISSING ({type(exc).__name__}: {exc})")
        continue
    where = os.path.dirname(getattr(module, "__file__", "") or "")
    print(f"  {name:<12} {getattr(module, '__version__', '?'):<14} {where}")
if "torch" in missing:
    sys.exit(1)
import torch

if torch.cuda.is_available():
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(f"  cuda         {torch.version.cuda:<14} {', '.join(names)}")
else:
    print("  cuda         not available")
sys.exit(1 if missing else 0)
EOF
}

impala() { "${IMPALA_PYTHON:-python3}" -m impala_rl.cli "$@"; }

_impala_setup
