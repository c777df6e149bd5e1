"""Data: load -> check records -> format/template -> tokenize -> mask labels -> check masks -> truncate -> pack -> collate.

    from finetune.data import build_datasets, Collator
    bundle = build_datasets(cfg, tokenizer)
    print(bundle.train_stats.summary())
    batch = Collator(pad_token_id=tokenizer.pad_token_id)(bundle.train[:4])

Every example is {"input_ids": [...], "labels": [...]} (packed rows add
"position_ids"). A label of IGNORE_INDEX (-100) means "not trained".

Modules, in the order data flows through them:
    sources    read files / folders / hub datasets, mix them with weights
    formats/   one module per data.format (its columns, checks, prompt/response or messages), and the registry
    records    applies the formats' checks to sources; column hints; `validate`'s checks
    templates  built-in chat templates (data.template) and end-of-turn tokens
    tokenize   records -> (input_ids, labels) for every format and data.train_on
    masks      the mask checker (data.mask_check)
    packing    bin packing (data.packing) and length grouping (data.group_by_length)
    dataset    flat-array storage, statistics, the collator
    cache      tokenized data on disk, keyed by everything that shapes it
    pairs      preference pairs: each side encoded as its format trains it, stored side by side
    pipeline   build_datasets, which runs the above
    show       `finetune data`: examples with trained tokens marked, statistics
"""

from finetune.data.dataset import Collator, DataBundle, DataStats, TokenizedData, count_tokens
from finetune.data.formats import FORMATS, get_format
from finetune.data.packing import length_grouped, pack_rows
from finetune.data.pairs import PreferencePairs
from finetune.data.pipeline import build_datasets, build_examples, check_sample, held_out_records
from finetune.data.records import check_data_source, held_out_indices
from finetune.data.sources import load_records
from finetune.data.templates import BUILTIN_TEMPLATES, use_template
from finetune.data.tokenize import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT, IGNORE_INDEX, generation_prompt, prompt_and_answer

__all__ = [
    "ALPACA_PROMPT",
    "ALPACA_PROMPT_NO_INPUT",
    "BUILTIN_TEMPLATES",
    "Collator",
    "DataBundle",
    "DataStats",
    "FORMATS",
    "IGNORE_INDEX",
    "PreferencePairs",
    "TokenizedData",
    "build_datasets",
    "build_examples",
    "check_data_source",
    "check_sample",
    "count_tokens",
    "generation_prompt",
    "get_format",
    "held_out_indices",
    "held_out_records",
    "length_grouped",
    "load_records",
    "pack_rows",
    "prompt_and_answer",
    "use_template",
]
