"""The engine: what one optimizer does when a gradient lands, and its rules.

``landing.py`` is the plain path (the hook and the step call); ``rules.py``
and ``boundaries.py`` the rules beside it (a backward's start and end, modes,
training-step boundaries); ``stepper.py`` the seam features wrap;
``subset.py`` and ``fastpath.py`` torch's step on exactly some parameters,
``wholestep.py`` where it cannot be (torch picks an update by the whole list).
Internal: users reach it through ``layeropt.attach`` and the optimizers.
"""
