"""Host-side ES controller (pure Python): jobs, staleness bound, cohorts, delay schedules."""
from jaxes.controller.config import ControllerConfig
from jaxes.controller.controller import Controller, Job, Update
from jaxes.controller.staleness import StalenessManager
from jaxes.controller.tasks import TaskSampler

__all__ = ["Controller", "ControllerConfig", "Job", "StalenessManager", "TaskSampler", "Update"]
