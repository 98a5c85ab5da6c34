"""spotrun: provably faithful restarts for preemptible PyTorch training on Ray.

``import spotrun`` is the public face: everything a job author uses is importable from here.

    import spotrun

    def build(ctx: spotrun.BuildContext) -> spotrun.Job:
        return spotrun.Job(model=..., data=spotrun.MapData(...), step=..., optimizer=...)

The engine lives in ``spotrun.trainer`` (once per rank) and ``spotrun.orchestrator`` (once per
job); a job never needs to import them.
"""

from spotrun.trainer import __version__
from spotrun.trainer.data.kinds import DataError, MapData, StreamData, TokenData
from spotrun.trainer.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from spotrun.trainer.job.contract import BuildContext, Job, JobError
from spotrun.trainer.job.sections import ModelSpec
from spotrun.trainer.job.spec import JobSpec
from spotrun.trainer.job.stateful import Stateful

__all__ = [
    "BuildContext", "CharTokenizer", "DataError", "HFTokenizer", "Job", "JobError", "JobSpec", "MapData",
    "ModelSpec", "Stateful", "StreamData", "TokenData", "Tokenizer", "__version__",
]
