"""The ranks of an attempt as the driver holds them: in this process or as Ray actors in one placement group
(actors run on the nodes).
"""
