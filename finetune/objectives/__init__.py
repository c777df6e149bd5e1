"""Training objectives: what a step minimises.

loss        the Loss protocol every objective implements (summed loss and units, metric sums, prepare);
            CausalLMLoss, the user's function as FunctionLoss
preference  dpo / orpo / simpo losses, the adapter-off reference and its precomputed table
rewards     grpo's reward functions: the built-ins a recipe names, the user's own (API, --rewards FILE.py)
sampling    completions sampled from the training model itself, cut at end tokens and stop strings
grpo        GRPO / Dr. GRPO / DAPO: completions sampled and scored in prepare(), the clipped objective
"""
