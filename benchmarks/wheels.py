"""Make ``.whl/``: the wheels the offline GPU machine lacks, for ``benchmarks/device_run.py`` to install.

    python3 benchmarks/wheels.py            # needs pip and the package index; writes .whl/ (git-ignored)

The GPU machine's image has torch, transformers, numpy, matplotlib, pytest, psutil, tqdm and more
(:data:`IMAGE_HAS`, from the machine's package list), but not DeepSpeed, hjson, pydantic or anything to
execute notebooks. This builds DeepSpeed's wheel (``pip wheel --no-deps``: its ops compile just in time
on the GPU machine), downloads the rest for CPython 3.12 on x86-64 Linux with their dependencies, deletes
what the image already has, and checks that every remaining wheel's requirements are met by the image or
by ``.whl/`` itself. About 40 wheels, 20-odd MB, and DeepSpeed's source in ``.whl/src/`` (2 MB), from which
``device_run.py`` compiles DeepSpeed's ops into a wheel on the GPU machine; the wheels it brings back go
into ``.whl/prebuilt/``, which this leaves as it is.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: What the course needs beyond the image, pinned as the course is tested (requirements.txt and its venv).
WANTED = ["hjson==3.1.0", "pydantic==2.14.4", "nbval==0.11.0", "nbclient==0.11.0", "nbformat==5.11.1",
          "ipykernel==7.4.0", "ipywidgets==8.1.9", "jupyter_client==8.10.0"]
DEEPSPEED = "deepspeed==0.19.8"
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64"]
#: Python packages of the GPU machine's image ('cuda', package list of 2026-11-17), normalized names.
IMAGE_HAS = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def project_of(wheel: Path) -> str:
    return normalize(wheel.name.split("-")[0])


def requirements_of(wheel: Path) -> list[str]:
    """The projects a wheel requires (markers for extras left out; other markers evaluated for
    CPython 3.12 on Linux by keeping anything not limited to other Pythons or platforms)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    found = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec, _, marker = line[len("Requires-Dist:"):].partition(";")
        if "extra" in marker or re.search(r"sys_platform\s*==\s*['\"](win32|darwin)", marker) \
                or re.search(r"platform_system\s*==\s*['\"](Windows|Darwin)", marker) \
                or re.search(r"python_version\s*<\s*['\"]3\.(1[0-2]|[0-9])['\"]", marker) \
                or "implementation_name == \"pypy\"" in marker or "platform_python_implementation == \"PyPy\"" in marker:
            continue
        found.append(normalize(re.split(r"[ <>=!~\[(;]", spec.strip())[0]))
    return found


def unmet(folder: Path) -> dict[str, list[str]]:
    """{wheel: [required projects neither in the image nor in ``folder``]}."""
    have = IMAGE_HAS | {project_of(w) for w in folder.glob("*.whl")}
    return {w.name: missing for w in sorted(folder.glob("*.whl"))
            if (missing := [r for r in requirements_of(w) if r not in have])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", type=Path, default=ROOT / ".whl")
    parser.add_argument("--check-only", action="store_true", help="only check an existing folder")
    args = parser.parse_args(argv)
    dest = args.dest
    if not args.check_only:
        dest.mkdir(exist_ok=True)
        pip = [sys.executable, "-m", "pip"]
        subprocess.run([*pip, "wheel", "--no-deps", "-q", "-w", str(dest), DEEPSPEED], check=True)
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run([*pip, "download", "-q", "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                        "cp", *platforms, "-d", str(dest), *WANTED], check=True)
        for wheel in dest.glob("*.whl"):
            if project_of(wheel) in IMAGE_HAS:
                wheel.unlink()
        for other in dest.iterdir():  # sdists pip fetched for the build: not installable offline
            if other.is_file() and other.suffix != ".whl":
                other.unlink()
        # DeepSpeed's source, for device_run.py to compile the ops into a wheel of their own on the machine
        subprocess.run([*pip, "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(dest / "src"),
                        DEEPSPEED], check=True)
    wheels = sorted(dest.glob("*.whl"))
    names = [project_of(w) for w in wheels]
    twice = sorted({n for n in names if names.count(n) > 1})
    problems = unmet(dest)
    size = sum(w.stat().st_size for w in wheels) / 1e6
    print(f"{len(wheels)} wheels, {size:.1f} MB in {dest}")
    sources = sorted((dest / "src").glob("deepspeed-*.tar.gz"))
    prebuilt = sorted((dest / "prebuilt").glob("deepspeed-*.whl"))
    print(f"DeepSpeed's source: {sources[-1].name if sources else 'none (ops compile just in time on the machine)'}; "
          f"with ops compiled in (.whl/prebuilt): {', '.join(p.name for p in prebuilt) or 'none yet'}")
    for wheel, missing in problems.items():
        print(f"  {wheel}: needs {', '.join(missing)} (neither in the image nor here)")
    if twice:
        print(f"  two versions of {', '.join(twice)}: keep one (pip refuses both)")
    return 1 if problems or twice else 0


if __name__ == "__main__":
    sys.exit(main())
