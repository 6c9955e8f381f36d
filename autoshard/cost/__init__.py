"""The cost model: hardware profiles and their calibration, collective times, FLOPs, one node's cost on
one mesh axis, ZeRO's and recomputation's costs and savings.
"""
