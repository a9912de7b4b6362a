"""The suite passes with a third-party plugin installed: the tests whose answers depend on which
backends exist (what "auto" picks, what ``kvcore plugins`` lists) pin this repository's plugins
(the ``own_plugins`` fixture). Checked by running those files with a throw-away plugin visible
as an installed distribution: a backend that wants every device more than any other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from _plugin_dists import clean_plugin_env, make_dist  # noqa: F401

import kvcore

ROOT = Path(__file__).resolve().parents[1]
#: The test files that depend on the installed backends (each pins them).
PINNED = ["tests/test_hf_defaults.py", "tests/test_kernel_requirements.py", "tests/test_kernel_rules.py",
          "plugins/kvcore-flashinfer/tests/test_flashinfer_plugin.py"]
EAGER = '''
import kvcore
from kvcore_torch import TorchAttentionBackend


class Eager(kvcore.AttentionBackend):
    name = "eager"
    forward = TorchAttentionBackend.__dict__["forward"]


@kvcore.hookimpl
def kvcore_register_backends(register):
    register(Eager)


@kvcore.hookimpl
def kvcore_backend_priority(backend, spec, device):
    return 1000 if backend is Eager else None
'''


def test_tests_that_depend_on_the_installed_backends_pass_with_another_plugin_installed(tmp_path, monkeypatch):
    make_dist(tmp_path, "kvcore-eager", "1.0", {"eager": "fakeplug_eager"}, {"fakeplug_eager": EAGER})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("KVCORE_PLUGINS", "torch,triton,flashinfer,eager")  # NOTE: others may be installed
    spec = kvcore.FullAttentionSpec(16, 2, 64, torch.float16)
    assert kvcore.select_backend(spec, "cpu", plugin_manager=kvcore.get_plugin_manager()).name == "eager"
    monkeypatch.delenv("KVCORE_PLUGINS")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *PINNED], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
