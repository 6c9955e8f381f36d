"""What the user hands autoshard, turned into one traced graph: the model factory and its checks,
torch.export tracing, sharding hints (and ColossalAI's tensor-parallel modes as hints), `constrain`
and pipeline stage marks.
"""
