"""How a run is spread over processes: one room per strategy, and launching them. (Each strategy's declaration,
what config and the planner ask, is in declarations/.)

room         what the loop asks of a strategy (Room), answered for one process; SplitRoom for those that sum
             their own gradients
ddp, fsdp, zero   the data-parallel rooms: DDP (+ ddp_hooks: grad_compression), FSDP2, DeepSpeed ZeRO
pipeline, tensor, context   the split rooms: stages on torch.distributed.pipelining (stages: the stage modules,
             what a rank loads, windows), Megatron's split of each layer, each sequence split (ring: the ring
             attention and Ulysses)
mesh         the launch's DeviceMesh over the split dimensions (pp, dp, cp, tp): each split room's process groups
distribute   which data-parallel strategy a launch runs; whole checkpoint states read back into shards
split_checks what a launch of N processes cannot split, read from the model's config.json before loading
rank_state   what each process holds alone (generators, PowerSGD state) for a checkpoint
runtime      Parallel: chooses the room and hands it the loop's questions; the accelerator
launch       torchrun for `finetune run --nproc N`, signals passed on, exit 75 of a rank that left restartable
health       the start-up check: every rank's versions and recipe agree, its memory said
"""
