"""DeepSpeed's probe of the ops this machine can build, run on import: a launcher that imports this module before it
forks its ranks (``mhf_dist.backend.RANK_MODULES``) probes once for all of them.

DeepSpeed probes on the first read of ``deepspeed.ops.__compatible_ops__`` and keeps the answer in that module; each
rank's process group start reads it (on CPU, for the shared-memory communication op). The probe imports setuptools'
distutils and compiles and links a test program: half a second of every CPU rank's start where each probes.
"""

from __future__ import annotations

import deepspeed.ops

COMPATIBLE_OPS: dict[str, bool] = deepspeed.ops.__compatible_ops__
