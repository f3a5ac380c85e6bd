"""The one place the course's helpers import DeepSpeed: after the accelerator is chosen.

DeepSpeed picks its accelerator (CUDA, CPU, ...) once, the first time it is imported, from
``$DS_ACCELERATOR`` or by looking for a GPU; on a machine without one it then warns that it found no
accelerator. :func:`choose_accelerator` sets the course's choice first (the rule :mod:`helpers.core.environment`
gives the ranks too), and :func:`load` imports a DeepSpeed module only after it::

    dist = ds.load("deepspeed.comm")                            # import deepspeed.comm as dist
    PipelineModule = ds.load("deepspeed.pipe").PipelineModule   # from deepspeed.pipe import PipelineModule
    offload = ds.load("deepspeed.runtime.zero.offload_config")  # several names of one module: the module, once

Every use is inside a function, so importing :mod:`helpers` never imports DeepSpeed. A rank's own script
(``runs/``, or a notebook's ``%%writefile``) keeps its plain ``import deepspeed``: the launcher set the
accelerator for it.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType


#: Environment variable that runs the course's ranks on the CPU (gloo) on a machine with GPUs: ``COURSE_DEVICE=cpu``
#: (:func:`helpers.core.environment.detect` sets it for a chapter that needs more ranks than the GPUs chosen).
DEVICE_VARIABLE = "COURSE_DEVICE"


def cpu_ranks_chosen() -> bool:
    """Whether this process runs the course's ranks on the CPU although GPUs may be present
    (``$COURSE_DEVICE=cpu``)."""
    return os.environ.get(DEVICE_VARIABLE, "").strip().lower() == "cpu"


def choose_accelerator() -> None:
    """Before DeepSpeed is imported in this process: on a machine without GPUs, or where the course runs its
    ranks on the CPU (``$COURSE_DEVICE=cpu``), say "CPU" up front, or DeepSpeed warns that it found no
    accelerator (or picks the GPU). A choice already in ``$DS_ACCELERATOR`` stands."""
    import torch  # deferred: the commands that run before torch is installed must not import it

    if not torch.cuda.is_available() or cpu_ranks_chosen():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def load(name: str = "deepspeed") -> ModuleType:
    """The DeepSpeed module ``name`` (``"deepspeed"`` or one of its submodules, ``"deepspeed.comm"``),
    imported after :func:`choose_accelerator` (once DeepSpeed is imported, its accelerator is fixed)."""
    if name != "deepspeed" and not name.startswith("deepspeed."):
        raise ValueError(f"ds.load({name!r}): name a DeepSpeed module, 'deepspeed' or 'deepspeed.<submodule>'")
    if "deepspeed" not in sys.modules:
        choose_accelerator()
    return importlib.import_module(name)
