"""What the HTTP frontend is composed from: the typed view of the running
service that frontend/app.py `start_servers` gets (supervisor.py's Supervisor
satisfies it; mypy checks that where start_servers is called), and the
narrow view of the serving state that the read-only routes get.

Only the composition in frontend/app.py sees a `Service`. Every handler gets
the config, its key check, the history it audits to, and the one part it
uses (`JsonHandler.parts`, frontend/base.py): the model store, the job
manager, the control plane's applies or rollouts, the serving state as a
`ServingView`, ... The predict pipeline (frontend/pipeline.py) and the
feedback service (control/feedback.py) are built there from a few parts,
once for both ports. Read-only members: nothing here rebinds them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from frontend.pipeline import Lookup, Serving

if TYPE_CHECKING:
    from control.applies import Applies
    from control.rollout_state import GoldenSets
    from control.jobs import JobManager
    from control.metrics import Metrics
    from control.policies import Policies
    from control.quality import Quality
    from control.records import RecordBackend
    from control.rollout_control import RolloutControl
    from control.status import StatusView
    from state.keys import KeyRing
    from state.predlog_api import PredictionLogBackend
    from state.statedb import StateDB
    from state.storage import Storage
    from state.store import ModelStore


class ServingView(Lookup, Protocol):
    """The serving state as the read-only routes see it (/readyz, /models,
    the Open Inference Protocol's readiness and metadata): control/serving.py
    ServingState, which the control plane alone changes."""

    @property
    def default_name(self) -> str | None: ...
    @property
    def ready(self) -> bool: ...


class Service(Serving, Protocol):
    """The running service, as frontend/app.py composes the routes from it
    (predict, serving_model and serving_names: the pipeline's Serving)."""

    # the serving state, read; the control plane's parts that change it
    @property
    def serving(self) -> ServingView: ...
    @property
    def applies(self) -> Applies: ...
    @property
    def rollouts(self) -> RolloutControl: ...
    @property
    def statusview(self) -> StatusView: ...

    # the other parts the routes use
    @property
    def store(self) -> ModelStore: ...
    @property
    def policies(self) -> Policies: ...
    @property
    def predlog(self) -> PredictionLogBackend: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def jobs(self) -> JobManager: ...
    @property
    def golden(self) -> GoldenSets: ...
    @property
    def storage(self) -> Storage: ...
    @property
    def records(self) -> RecordBackend: ...
    @property
    def quality(self) -> Quality: ...
    @property
    def db(self) -> StateDB: ...
    @property
    def keys(self) -> KeyRing | None: ...
