"""Plan: what the compiler decided, as a table and as a JSON file; diffs between plans and explanations
of single decisions.
"""
