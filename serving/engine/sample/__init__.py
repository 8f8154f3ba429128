"""Sampling on the device, inside the jitted steps: greedy, temperature, top-k/p, min-p, the
logit processors (bias, min_tokens, penalties over per-slot token counts), the structured-output
bitmask, and log probabilities.

May import: serving.contract, serving.config, serving.core.sched.
"""
