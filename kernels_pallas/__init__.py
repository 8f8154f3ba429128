"""Paged attention kernels (Pallas for TPU and GPU) beside their pure-XLA reference, their
block sizes per backend, and the KV storage convention; they never ask which platform they run on.

May import: nothing of ours.
"""
