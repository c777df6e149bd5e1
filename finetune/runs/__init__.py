"""A run's directory: what is written while training, and what is done with a run afterwards.

report      where metrics go besides metrics.jsonl (TensorBoard, W&B, a loss-curve PNG)
checkpoint  atomic directories, manifests, safetensors + JSON
resume      which checkpoint a run continues from, and whether it may
evaluate    loss and generation (exact / contains match); the held-out loss during a run
preflight   everything checked before weights load, reported together (`finetune validate`)
open        a finished run opened: its recipe, tokenizer, model as trained; generate
merge       the streaming merge of an adapter into 4-bit-rounded base weights
export      the adapter or a merged model, checked against the adapter before it is written
"""
