r"""Prints the commands that fill a wheel folder for `run.sh` (nothing else).

A GPU host without network access has JAX, flax, optax, orbax, h5py, torch,
pandas, ... already (its image's package list: `--image_packages`, one name
a line; default the list of this project's device machines), but not
grain_cells' other needs. This walks the requirements of `grain_cells[train]`
(and scDataset, the peer) as installed in *this* Python, keeps those the
image lacks, and prints:

* `pip wheel --no-deps` of grain_cells itself (its build needs setuptools>=77,
  fetched by pip's build isolation), and
* one `pip download --no-deps --only-binary=:all:` for the rest, at the
  versions installed here (the ones this project is tested with), for
  CPython 3.12 on manylinux x86_64.

Run the printed commands where pip can reach PyPI, then carry the folder
(a few tens of MB; keep it out of the repository: it is passed by path).

Usage:
  python benchmarks/gpu_host/wheelhouse.py --dest=/tmp/gc-wheels
  python benchmarks/gpu_host/wheelhouse.py --image_packages=pip-list.txt
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shlex
import sys

from absl import app, flags

_DEST = flags.DEFINE_string("dest", "/tmp/gc-wheels", "The wheel folder.")
_IMAGE = flags.DEFINE_string(
    "image_packages",
    None,
    "File of the packages the GPU host has (one name a line, or `pip list` "
    "output); default: the device image list below.",
)
_PYTHON = flags.DEFINE_string("python_version", "3.12", "The host's Python.")
_EXTRA = flags.DEFINE_list(
    "also",
    ["scdataset==0.3.0"],
    "More packages to bring (pinned; their needs too where installed here).",
)

# The 'cuda' image of this project's device machines, as read on 2026-11-17
# (Python 3.12; JAX 0.11 with CUDA 13, torch 2.11, flax, optax, orbax, h5py,
# numpy, scipy, pandas: none of them is replaced).
_IMAGE_TEXT = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal
annotated-doc anyio attrs botorch build certifi charset-normalizer chex
click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta
jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax
llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson
ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions
nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11
py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu
safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"""
IMAGE = _IMAGE_TEXT.split()

PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    """The names the host has."""
    if not _IMAGE.value:
        return {_norm(n) for n in IMAGE}
    names = set()
    with open(_IMAGE.value) as f:
        for line in f:
            word = line.split()[0] if line.split() else ""
            if word and not word.startswith(("Package", "---")):
                names.add(_norm(word.split("==")[0]))
    return names


def closure(roots: list[str]) -> dict[str, str]:
    """Installed name -> version of the roots and everything they need here."""
    env = {"python_version": _PYTHON.value, "sys_platform": "linux"}
    seen: dict[str, str] = {}
    todo = [(r, ()) for r in roots]
    while todo:
        name, extras = todo.pop()
        key = _norm(name)
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            print(f"# not installed here, skipped: {name}", file=sys.stderr)
            continue
        seen[key] = dist.version
        for req in dist.requires or ():
            from packaging.requirements import Requirement

            r = Requirement(req)
            if r.marker is not None and not any(
                r.marker.evaluate({**env, "extra": e}) for e in (*extras, "")
            ):
                continue
            todo.append((r.name, tuple(r.extras)))
    return seen


def main(argv):
    del argv
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    have = image_packages()
    # The project's own needs (train extra), without the project itself.
    from packaging.requirements import Requirement

    also = [Requirement(a) for a in _EXTRA.value]
    wanted = closure(["grain_cells", *(a.name for a in also)])
    for a in also:  # not installed here: bring it as pinned
        pin = next(iter(a.specifier), None)
        if _norm(a.name) not in wanted and pin is not None:
            wanted[_norm(a.name)] = pin.version
    project = md.distribution("grain_cells")
    train = [
        r.split(";")[0].strip()
        for r in project.requires or ()
        if 'extra == "train"' in r
    ]

    wanted.update(closure([Requirement(t).name for t in train]))
    wanted.pop("grain-cells", None)
    missing = {n: v for n, v in sorted(wanted.items()) if n not in have}
    dest = shlex.quote(_DEST.value)
    print(f"mkdir -p {dest}")
    print(f"python -m pip wheel --no-deps -w {dest} {root}")
    plats = " ".join(f"--platform {p}" for p in PLATFORMS)
    pins = " ".join(f"{n}=={v}" for n, v in missing.items())
    print(
        f"python -m pip download --no-deps --only-binary=:all: "
        f"--python-version {_PYTHON.value} --implementation cp {plats} "
        f"-d {dest} {pins}"
    )


if __name__ == "__main__":
    app.run(main)
