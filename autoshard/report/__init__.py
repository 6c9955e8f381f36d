"""What people look at: pictures of a plan, pipeline timelines (planned and measured) and progress bars.
"""
