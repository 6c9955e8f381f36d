"""The search engines the passes call: the sharding ILP (HiGHS), repeated-layer detection and the
redistribution planner (the collectives between two specs).
"""
