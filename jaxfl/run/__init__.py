"""Running experiments: the run configuration, the CLI, the runner (build, host loop, logging), checkpoints,
reliability reports and plots."""
from .config import RunConfig
from .reliability import predict_proba, reliability_report
from .runner import Experiment, RunResult, run


__all__ = ["Experiment", "RunConfig", "RunResult", "predict_proba", "reliability_report", "run"]
