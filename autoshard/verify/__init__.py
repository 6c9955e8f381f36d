"""`verify`: train the parallel program beside the single-device model and compare losses, gradients
and parameters within per-dtype tolerances; the training features a verified step uses.
"""
