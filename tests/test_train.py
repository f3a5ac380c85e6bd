"""helpers.core.train's ``initialize`` hook: a run names the function that makes its engine (a chapter's page
writes its own ``deepspeed.initialize`` call), or the loop makes it with the source article's call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.core import environment, launch, plan

#: A chapter's own ``initialize``: it passes a client optimizer (SGD) the default call never passes, and
#: returns deepspeed.initialize's whole tuple; ``not_an_engine`` returns the model.
PAGE = '''
import deepspeed
import torch


def initialize(model, config, run):
    config = {key: value for key, value in config.items() if key != "optimizer"}  # the client optimizer's place
    return deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)


def not_an_engine(model, config, run):
    return model
'''

#: One rank in this test's own process group trains a run without a hook, one with the page's, one with a hook
#: that returns no engine, through the ranks' own ``train_run``; prints what each run recorded.
RANK = """
import json, os, sys, time
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                  DS_ACCELERATOR="cpu")
sys.path.insert(0, sys.argv[1])
import deepspeed
from helpers.core import configs, plan, train
deepspeed.init_distributed(dist_backend="gloo")
found = {}
for name, hook in (("default", None), ("page", "page_initialize:initialize"), ("bad", "page_initialize:not_an_engine")):
    out = os.path.join(sys.argv[1], name)
    os.makedirs(out)
    with open(os.path.join(out, "ds_config.json"), "w") as f:
        json.dump(configs.load("zero0"), f)
    run = plan.PlannedRun(name=name, out=out, config=os.path.join(out, "ds_config.json"), model="mlp", steps=2,
                          seed=0, probes=[], plan=os.path.join(out, "plan.json"),
                          **({"initialize": hook} if hook else {}))
    try:
        train.train_run(run, 0, 1, time.time())
        with open(os.path.join(out, "summary.json")) as f:
            summary = json.load(f)
        found[name] = {"basic_optimizer": summary["basic_optimizer"], "losses": summary["losses"]}
    except TypeError as error:
        found[name] = {"error": str(error)}
print("FOUND " + json.dumps(found))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("initialize-hook")
    (folder / "page_initialize.py").write_text(PAGE)
    done = subprocess.run([sys.executable, "-c", RANK, str(folder), str(launch.free_port())], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parent.parent)
    line = next((l for l in done.stdout.splitlines() if l.startswith("FOUND ")), None)
    assert line, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(line[len("FOUND "):])


def test_without_a_hook_the_loop_makes_the_engine_with_the_configs_optimizer(trained):
    assert trained["default"]["basic_optimizer"] == "AdamW"


def test_a_runs_own_initialize_makes_the_engine_it_trains(trained):
    assert trained["page"]["basic_optimizer"] == "SGD"
    assert trained["page"]["losses"][0] == pytest.approx(trained["default"]["losses"][0])  # same model, same samples
    assert trained["page"]["losses"][1] != pytest.approx(trained["default"]["losses"][1])  # another optimizer's step


def test_an_initialize_that_returns_no_engine_is_named(trained):
    assert "page_initialize:not_an_engine" in trained["bad"]["error"]
    assert "return the engine" in trained["bad"]["error"]


def test_the_plan_carries_the_specs_initialize_or_the_default(tmp_path):
    env = environment.detect(2)
    default = launch._planned(launch._prepare(launch.RunSpec("zero1", model="mlp", out=tmp_path / "a"), 2, env),
                              tmp_path / "plan.json")
    assert default.initialize == plan.DEEPSPEED_INITIALIZE == "helpers.core.train:initialize"
    named = launch.RunSpec("zero1", model="mlp", out=tmp_path / "b", initialize=plan.DATA_PARALLEL_STEP)
    assert launch._planned(launch._prepare(named, 2, env), tmp_path / "plan.json").initialize == plan.DATA_PARALLEL_STEP


@pytest.mark.parametrize("spec, match", [
    (launch.RunSpec("zero1", model="mlp", initialize="helpers.core.train:no_such_function"), "initialize="),
    (launch.RunSpec("zero1", model="mlp", initialize=plan.DATA_PARALLEL_STEP, client_optimizer=True),
     "client_optimizer=True"),
])
def test_a_bad_initialize_is_refused_before_any_process_starts(spec, match):
    with pytest.raises(ValueError, match=match):
        launch._prepare(spec, 2, environment.detect(2))



#: Imports the harness the way a rank's script does (after torch and DeepSpeed) and prints how many objects the
#: garbage collector was told to leave alone, then whether a cycle made afterwards is still collected.
FREEZE = """
import gc, os, sys
sys.path.insert(0, sys.argv[1])
os.environ["DS_ACCELERATOR"] = "cpu"
import torch, deepspeed
from helpers.core import train
frozen = gc.get_freeze_count()
cycle = []
cycle.append(cycle)
del cycle
print(frozen, gc.collect())
"""


@pytest.mark.parametrize("rank", [True, False])
def test_a_rank_leaves_its_imports_out_of_garbage_collection_and_a_kernel_does_not(rank):
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK")}
    if rank:
        env["LOCAL_RANK"] = "0"
    out = subprocess.run([sys.executable, "-c", FREEZE, str(environment.REPO_ROOT)], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    frozen, collected = int(out[-2]), int(out[-1])
    if rank:
        assert frozen > 100_000  # torch's, DeepSpeed's and torch._dynamo's module objects
    else:
        assert frozen == 0
    assert collected >= 1  # what is made after the freeze is still collected
