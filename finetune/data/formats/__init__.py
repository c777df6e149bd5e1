"""The data formats (data.format): one module per format, each defining one Format.

    from finetune.data.formats import FORMATS, get_format
    get_format("alpaca").texts({"instruction": "Add.", "output": "3"})  # (the alpaca prompt, "3")

Adding a format: a module here defining FORMAT (see base.Format and input_output.py,
the smallest chat one), one import line below, its name in finetune.config.sections.DataFormat,
its row in README's Data table (a test compares them), and a golden-mask test.
Modules are imported by name here, never by a name from a recipe.
"""

from __future__ import annotations

import difflib
from typing import get_args

from finetune.config.schema import DataFormat
from finetune.data.formats import alpaca, completion, input_output, messages, preference, prompt, sharegpt, text
from finetune.data.formats.base import Format, Problem
from finetune.errors import DataError

_MODULES = (alpaca, completion, input_output, messages, preference, prompt, sharegpt, text)
FORMATS: dict[str, Format] = {m.FORMAT.name: m.FORMAT for m in _MODULES}

# config/schema.py cannot import this package (imports flow one way), so it spells the names out; they must agree.
if tuple(FORMATS) != get_args(DataFormat) or any(m.__name__.rsplit(".", 1)[1] != m.FORMAT.name for m in _MODULES):
    raise ImportError(
        f"finetune.config.sections.DataFormat lists {get_args(DataFormat)}, finetune/data/formats/ defines {tuple(FORMATS)} "
        f"in modules {[m.__name__.rsplit('.', 1)[1] for m in _MODULES]}: make all three the same, in the same order"
    )


def get_format(name: str) -> Format:
    """The Format called `name`; a DataError with a did-you-mean for an unknown one."""
    if name in FORMATS:
        return FORMATS[name]
    close = difflib.get_close_matches(name, list(FORMATS), n=1, cutoff=0.6)
    hint = (f"did you mean '{close[0]}'? " if close else "") + f"formats: {', '.join(FORMATS)}"
    raise DataError(f"unknown data.format {name!r}", hint=hint)


__all__ = ["FORMATS", "Format", "Problem", "get_format"]
