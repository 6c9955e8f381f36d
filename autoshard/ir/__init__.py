"""The values every stage shares: the device mesh, placements and specs (with their gradient duals),
the `node.meta` keys, graph-editing helpers, the mixed-precision policy, JSON file reading and the
errors users see. Nothing here imports another autoshard package.
"""
