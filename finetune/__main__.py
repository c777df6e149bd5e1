"""python -m finetune run recipes/demo-cpu.yaml (same as the `finetune` command; torchrun's workers run this)."""

import os
import sys

from finetune.cli.commands import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # A worker of a multi-process launch leaves without interpreter finalization: a collective
    # library's C++ thread destroyed there can abort a finished run (SIGABRT, "terminate called
    # without an active exception", seen in CI with FSDP) and turn its success into a failed job.
    # Everything the run writes is closed by now (metrics, checkpoints, adapter, process group).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
