"""Loading an engine leaves no OpenMP team behind in the thread that called it.

A worker's main thread outlives `Engine.load`. Any torch (or tokenizer) work it runs keeps an OpenMP
team alive beside the generation thread's; with more OpenMP threads than cores libgomp stops
spinning at barriers and every decode step of a lone request got ~40% slower (docs/engine.md).
The teams are counted from outside with gdb, as they were found: by libgomp's thread entry point.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("gdb") is None, reason="needs gdb to count OpenMP threads")

CHILD = r"""
import sys
import django
django.setup()
from dataclasses import replace
import torch
from inference.engine.loop import Engine
from inference.engines import engine_config_from_settings, model_dir

engine = Engine(replace(engine_config_from_settings(model_dir()), num_blocks=64))
engine.load(progress=lambda _: None)
print("loaded", flush=True)
sys.stdin.readline()
# The control: the same main thread running one parallel matmul does grow a team.
torch.mm(torch.ones(512, 512), torch.ones(512, 512))
print("worked", flush=True)
sys.stdin.readline()
"""


def openmp_workers(pid: int) -> int:
    """Threads of `pid` started by libgomp (each frame list of a pool thread has gomp_thread_start)."""
    backtraces = subprocess.run(
        ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt"],
        capture_output=True, text=True, timeout=120,
    ).stdout
    return backtraces.count("gomp_thread_start")


def settle(pid: int) -> None:
    """Give threads that are leaving (a finished thread's team) time to exit before counting."""
    for _ in range(50):
        before = len(os.listdir(f"/proc/{pid}/task"))
        time.sleep(0.2)
        if len(os.listdir(f"/proc/{pid}/task")) == before:
            return


def test_loading_an_engine_leaves_no_openmp_team_in_the_calling_thread():
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root), "DJANGO_SETTINGS_MODULE": "project.settings"}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             env=env, cwd=root, text=True)
    try:
        assert child.stdout.readline().strip() == "loaded"
        settle(child.pid)
        assert openmp_workers(child.pid) == 0
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "worked"
        assert openmp_workers(child.pid) >= 1, "gdb saw no libgomp thread even after main-thread torch work"
    finally:
        child.kill()
        child.wait()
