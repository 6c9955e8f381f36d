"""What runs the per-rank programs: communicators and collectives (autograd functions whose backward is
the dual redistribution), rank modules with gradient sync, ZeRO, the pipeline runtime, process groups
and the single-process simulator (every rank a thread, bit-identical to real gloo ranks).

>>> import torch
>>> from autoshard.ir.mesh import Mesh
>>> from autoshard.runtime.collectives import all_gather
>>> from autoshard.runtime.simulator import run_on_mesh
>>> run_on_mesh(Mesh((2,), ("dp",)), lambda comm: all_gather(torch.tensor([comm.rank]), "dp", 0))
{0: tensor([0, 1]), 1: tensor([0, 1])}
"""
