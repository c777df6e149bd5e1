"""A run's directory: what is written while training, and a finished run opened (finetune/export/ turns it
into something else).

report      where metrics go besides metrics.jsonl (TensorBoard, W&B, a loss-curve PNG)
checkpoint  atomic directories, manifests, safetensors + JSON
resume      which checkpoint a run continues from, and whether it may
evaluate    loss and generation (exact / contains match); the held-out loss during a run
preflight   everything checked before weights load, reported together (`finetune validate`)
open        a finished run opened: its recipe, tokenizer, model as trained; generate
"""
