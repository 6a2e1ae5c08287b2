"""Runs the multi-device suite in its own process with 8 forced host devices."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_multidevice_suite_in_its_own_process():
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  env["XLA_FLAGS"] = flags.strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/multidevice"],
    cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False,
  )
  print(proc.stdout[-5000:])
  assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
  assert " passed" in proc.stdout and "no tests ran" not in proc.stdout
