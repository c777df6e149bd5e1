"""Shipped recipes (installed as finetune.recipes). Run `finetune ls` to list them."""
