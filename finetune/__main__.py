"""python -m finetune run recipes/demo-cpu.yaml (same as the `finetune` command)."""

import sys

from finetune.cli import main

sys.exit(main())
