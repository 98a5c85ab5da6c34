"""spotrun: provably faithful restarts for preemptible PyTorch training on Ray.

``import spotrun`` is the public face: everything a job author uses is importable from here.
The engine lives in ``spotrun.trainer`` (once per rank) and ``spotrun.orchestrator`` (once per
job); a job never needs to import them.
"""

from spotrun.trainer import __version__

__all__ = ["__version__"]
