#!/usr/bin/env bash
# Builds .gpu-kit/ for the device machine: the shared kit (../shared/gpu/make-kit.sh, see its README),
# made to fit this project. Run from the project root after `make install` (or `make gpu-kit`):
#
#   bash benchmarks/gpu_kit.sh
#
# and start each device call (carry [".gpu-kit"]) with `source .gpu-kit/env.sh || exit 1;` as usual.
# What it changes in the shared kit:
# - env.sh links every sub-package that pyproject.toml's package-dir maps into the `vitray` namespace
#   on the device. The shared env.sh names a fixed list of folders older than runfolder/ and storage/:
#   with it, `import vitray.trainers.loop` fails there ("cannot import name 'storage' from 'vitray'").
# - wheels for what the device lacks and vitray or run_gpu.sh needs: google-crc32c (every
#   checkpoint's CRC-32C; without it vitray checksums in pure Python, far slower), torchao built for
#   the device's torch (precision.dtype=fp8; TORCHAO=0.17.0 by default, the release for torch 2.11),
#   and pytest with its dependencies (run_gpu.sh's `checks` group).
# - env.sh's last step imports what a real run and the checks import, so that a kit that cannot run
#   them fails in the first seconds of a device call, not minutes into it.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCHAO=${TORCHAO:-0.17.0}
SHARED=../shared/gpu/make-kit.sh
[ -f "$SHARED" ] || { echo "no $SHARED: the device kit is built from the shared kit next to the project" >&2; exit 2; }
bash "$SHARED"
KIT=.gpu-kit

python3 - "$KIT/env.sh" <<'PY'
import re, sys
path = sys.argv[1]
text = open(path).read()
fixed = re.compile(r'^for p in [^;\n]*; do ln -sfn "\$ROOT/\$p" "/tmp/vpkg/vitray/\$p"; done$', re.M)
if not fixed.search(text):
    sys.exit(f"{path}: the shared env.sh no longer links a fixed list of folders; check it against pyproject.toml")
every_package = (  # each "vitray.NAME" = "FOLDER" of package-dir, as the line "NAME FOLDER"
    "python3 -c 'import tomllib; dirs = tomllib.load(open(\"pyproject.toml\", \"rb\"))[\"tool\"][\"setuptools\"][\"package-dir\"]; "
    "print(chr(10).join(name.partition(\".\")[2] + \" \" + folder for name, folder in dirs.items()))' |\n"
    '    while read -r name folder; do ln -sfn "$ROOT/$folder" "/tmp/vpkg/vitray/$name"; done'
)
text = fixed.sub(lambda _: every_package, text)
text += (
    'python3 -c "import google_crc32c, torchao, pytest, vitray.storage, vitray.runfolder, vitray.cluster.train_worker, '
    'vitray.trainers.checkpoint.rank_files, vitray.trainers.step.float8; print(\'kit: torchao\', torchao.__version__)"\n'
)
open(path, "w").write(text)
PY

pin() { grep -i "^$1==" requirements.lock | head -1; }
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
for spec in "$(pin google-crc32c)" "$(pin pytest)" "$(pin pluggy)" "$(pin iniconfig)" "$(pin packaging)" "torchao==$TORCHAO"; do
    [ -n "$spec" ] || { echo "a kit package is not in requirements.lock" >&2; exit 2; }
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT \
        -d "$KIT/whl" "$spec" 2>&1 | grep -v '^WARNING' || true
    wheel=${spec%%==*}  # a wheel's file name spells the project's name with underscores
    ls "$KIT"/whl/"${wheel//-/_}"-*.whl >/dev/null 2>&1 || { echo "no wheel for $spec in $KIT/whl" >&2; exit 1; }
done
du -sh "$KIT"
