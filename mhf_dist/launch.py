"""Starting ranks: N local processes through torchrun (``mhf-dist train --nproc-per-node N``)."""

from __future__ import annotations

import subprocess
import sys


def launch_local(nproc: int, argv: list[str]) -> int:
    """Re-run ``mhf-dist <argv>`` as ``nproc`` ranks on this machine; returns the launcher's exit code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "mhf_dist", *argv]
    return subprocess.call(cmd)
