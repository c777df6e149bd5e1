"""What config asks before anything loads, with no model code: each idea declared once, and the rules it brings.

techniques   one declaration per memory technique (keys, --fit choices, resume, host RAM) and every memory.* /
             strategy rule; its Modes are the fields the planner's Setup and the rules' Settings inherit
objectives   train.objective (sft | dpo | orpo | simpo | grpo): what each needs, one table (config, planner)
strategies   one declaration per data-parallel strategy (ddp, fsdp, zero2, zero3): what the planner, --fit and
             the rules ask of it, never its name
splits       one declaration per split strategy (pipeline, tensor, context): its size key, recipe keys, rules
zero_config  distributed.strategy=deepspeed: ZeRO-2/3 rules and DeepSpeed's config
compression  distributed.grad_compression rules and defaults
layout       the grid of stages x replicas x context x tensor ranks, and what a launch or model cannot split

Each strategy's runtime is its room in parallel/; each technique's, its module in memory/.
"""
