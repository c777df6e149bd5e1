"""How a run is spread over processes: DDP, FSDP2 or DeepSpeed ZeRO, and launching them.

strategies   one declaration per strategy (ddp, fsdp, zero2, zero3): what the planner, --fit and the
             rules ask of it; stands before config/, and no other floor compares a strategy's name
splits       one declaration per split strategy (pipeline, tensor, context): recipe keys, rules, traits; stands
             before config/
zero         distributed.strategy=deepspeed: ZeRO-2/3 rules and DeepSpeed's config; stands before config/
compression  distributed.grad_compression rules and defaults; stands before config/
strategy     which strategy a run uses, FSDP2 sharding, whole (gathered) states for checkpoints
split_checks what a launch of N processes cannot split, read from the model's config.json before loading
rank_state   what each process holds alone (generators, PowerSGD state) for a checkpoint
ddp_hooks    the DDP communication hooks of grad_compression
runtime      Parallel: the one object the loop asks (gradient sync, global sums, whole states); the accelerator
launch       torchrun for `finetune run --nproc N`, signals passed on, exit 75 of a rank that left restartable
health       the start-up check: every rank's versions and recipe agree, its memory said
"""
