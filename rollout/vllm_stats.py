"""What vLLM's scheduler says about its load, read off the scheduler stats vLLM hands its
stat loggers after every engine step (the only place vLLM reports them to the frontend)."""

from __future__ import annotations

from typing import Any


class SchedulerLoad:
    """The latest KV-cache use (0..1) and running requests of one vLLM engine, and the
    most requests it ever ran at once."""

    def __init__(self) -> None:
        self.kv_cache_usage = 0.0
        self.running = 0
        self.most_running = 0

    def record(self, kv_cache_usage: float, running: int) -> None:
        self.kv_cache_usage, self.running = kv_cache_usage, running
        self.most_running = max(self.most_running, running)

    def logger_factory(self) -> Any:
        """A vLLM per-engine stat-logger factory that records here (needs vLLM; pass it
        as `AsyncLLM.from_engine_args(..., stat_loggers=[...])`)."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        load = self

        class Recorder(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                del vllm_config, engine_index

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    stats = scheduler_stats
                    load.record(float(stats.kv_cache_usage), int(stats.num_running_reqs))

            def log_engine_initialized(self) -> None:
                pass

        return Recorder
