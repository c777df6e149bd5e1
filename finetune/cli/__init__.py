"""The command line (`finetune run | validate | plan | export | ...`): the only package that imports them all.

`finetune.cli:main` is the console script's entry point (pyproject.toml), kept here so an
install made before the commands moved into cli/commands.py keeps working.
"""

from finetune.cli.commands import main

__all__ = ["main"]
