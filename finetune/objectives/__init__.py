"""Training objectives: what a step minimises.

table       train.objective (sft | dpo | orpo | simpo): what each needs, one table (config, planner);
            stands before config/
loss        the Loss protocol every objective implements (summed loss and units, metric sums);
            CausalLMLoss, the user's function as FunctionLoss
preference  dpo / orpo / simpo losses, the adapter-off reference and its precomputed table
"""
