"""Searches above one compile: whether and how to pipeline (by predicted step time) and planning at
scale on paper (data, tensor and pipeline degrees, micro-batches, recomputation).
"""
