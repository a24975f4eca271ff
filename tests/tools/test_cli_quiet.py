"""The command line hides the start-up lines every command used to print (issue 12): JAX's INFO
``Unable to initialize backend 'tpu': ... libtpu.so`` and transformers' ``PyTorch was not found`` advice
(``make run`` installs no torch); and (issue 43) every other JAX INFO line, such as ``Resetting cache``. Each
check runs with and without ``quiet_third_party_startup`` so it can fail."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import logging, sys
sys.modules["torch"] = None                 # as in a `make run` install: no PyTorch
if {quiet}:
    from stapo_jax.tools.cli import quiet_third_party_startup
    quiet_third_party_startup()
logging.basicConfig(level=logging.INFO)     # what train / eval / sft configure
import jax
print(jax.devices()[0].platform)
from stapo_jax.runtime.compile_stats import enable_compilation_cache
enable_compilation_cache(None)               # what every command did at start (issue 43: "Resetting cache")
jax.jit(lambda x: x + 1)(1.0)
import transformers
"""


def _run(quiet: bool) -> tuple[str, str]:
    """(platform of the default JAX backend, stderr) of the start-up script."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSFORMERS_NO_ADVISORY_WARNINGS", "JAX_PLATFORMS")}
    r = subprocess.run([sys.executable, "-c", SCRIPT.format(quiet=quiet)], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env={**env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip(), r.stderr


def test_libtpu_info_and_pytorch_advice_are_hidden():
    platform, loud = _run(quiet=False)
    # on a TPU host the TPU backend starts, so there is no failed probe to hide
    assert ("Unable to initialize backend 'tpu'" in loud) == (platform != "tpu")
    assert "PyTorch was not found" in loud
    assert "Resetting cache" in loud
    _, quiet = _run(quiet=True)
    assert "libtpu" not in quiet and "Unable to initialize backend" not in quiet
    assert not [line for line in quiet.splitlines() if line.startswith("INFO:jax")], quiet  # no JAX INFO line
    assert "PyTorch was not found" not in quiet
