"""The engine: requests, the scheduler, the model runner, sampling and the LLM API.

``Scheduler`` and ``Request`` are model-free (the simulator drives them with fake
tokens); ``LLMEngine``/``LLM`` add the model, the attention backend and sampling.
"""

from kvpage.engine.config import EngineConfig
from kvpage.engine.engine import METRIC_NAMES, LLMEngine
from kvpage.engine.llm import LLM
from kvpage.engine.params import CompletionOutput, RequestOutput, SamplingParams
from kvpage.engine.request import Request, RequestStatus, sample_id
from kvpage.engine.sampler import Sampler
from kvpage.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = [
    "LLM",
    "METRIC_NAMES",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "Sampler",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "sample_id",
]
