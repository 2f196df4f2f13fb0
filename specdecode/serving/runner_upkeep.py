"""What a model service runs beside its model runner once the model is loaded: the runner's
metrics, its forward-cost table kept fresh from live forwards and re-measured while the
service idles (specdecode.serving.recalibration), and its compiled forwards compiled in the
background (specdecode.executor.compile_mode). The scorer and a draft-model proposer alike."""

from __future__ import annotations

from specdecode.cost_model import ForwardCosts
from specdecode.executor.calibration import attach_live_costs
from specdecode.executor.compile_mode import BackgroundCompile
from specdecode.executor.cost_cache import CostCache
from specdecode.executor.model_runner import ModelRunner
from specdecode.serving.model_access import ModelAccess
from specdecode.serving.model_metrics import export_runner_metrics
from specdecode.serving.recalibration import Recalibrator


class RunnerUpkeep:
    def __init__(self, access: ModelAccess):
        """access: the service's one-call-at-a-time model access, which the re-measurement
        yields to."""
        self.access = access
        self._background: list[Recalibrator | BackgroundCompile] = []

    def attach(self, runner: ModelRunner, costs: ForwardCosts, role: str,
               cache: CostCache | None = None) -> None:
        """At load: export the runner's metrics as `role`'s, keep `costs` fresh from its
        forwards (each re-measured table kept in `cache`), and prepare the work that starts
        once the service serves."""
        export_runner_metrics(runner, role)
        attach_live_costs(runner, costs)
        self._background.append(Recalibrator(runner, costs, self.access,
                                             on_replace=cache.save if cache else None))
        if BackgroundCompile.needed(runner):
            self._background.append(BackgroundCompile(runner))

    def start(self) -> None:
        """Once the service serves: the idle re-measurement, then the background compile."""
        for work in self._background:
            work.start()
