"""The compiled result: Program (per-rank modules of one plan), pipelines (options, micro-batch
program) and PipelineProgram (per-rank stage modules under a schedule).
"""
