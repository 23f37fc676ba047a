"""The worker side of the vLLM engine (`rollout/vllm_engine.py`): methods vLLM mixes into
its worker class (`worker_extension_cls`), run in the worker process over
`collective_rpc`: full-vocabulary log-probs and the layer-wise in-place weight reload.
vLLM is imported inside the methods, so this module imports without it."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from rollout.vllm_weights import decode_bucket

PATCHED = "_dapo_full_vocab_logprobs"  # set on vLLM's sampler once its forward is wrapped


def exit_when_gone(pid: int, poll_s: float = 1.0) -> None:
    """A daemon thread that, once `pid` has exited (a zombie counts; a reused pid is told
    apart by its start time), kills vLLM's engine core (this worker's parent, when the
    worker runs in a process of its own: the engine core does not notice its frontend's
    death and keeps polling) and ends this process."""
    import psutil

    owner = psutil.Process(pid)
    parent = psutil.Process(os.getppid())
    title = " ".join([parent.name(), *parent.cmdline()])  # comm cuts it: VLLM::EngineCor
    engine_core = parent if parent.pid != pid and "VLLM::EngineCor" in title else None

    def gone() -> bool:
        try:
            return not owner.is_running() or owner.status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def watch() -> None:
        while not gone():
            time.sleep(poll_s)
        if engine_core is not None:
            engine_core.kill()
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="dapo-owner-watch").start()


class DapoWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); runs in the worker process.

    Methods are prefixed `dapo_` because vLLM refuses extensions whose names clash with
    the worker's own attributes.
    """

    model_runner: Any
    vllm_config: Any

    def dapo_exit_with(self, pid: int) -> None:
        """End vLLM's processes once process `pid` (the rollout server that started vLLM)
        is gone: without it a rollout server killed by SIGKILL leaves vLLM's engine core
        (busy polling) and worker, and the memory they hold, behind."""
        exit_when_gone(pid)

    def dapo_use_full_vocab_logprobs(self) -> None:
        """Return log_softmax of the temperature-scaled logits, before top-k/top-p."""
        sampler = self.model_runner.sampler.topk_topp_sampler
        if getattr(sampler, PATCHED, False):  # probe-ok: vLLM's sampler, marked when patched
            return
        truncate_and_sample = sampler.forward

        def forward(logits: torch.Tensor, generators: Any, k: Any, p: Any) -> Any:
            logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before in-place edits
            tokens, _ = truncate_and_sample(logits, generators, k, p)
            return tokens, logprobs

        sampler.logprobs_mode = "raw_logprobs"  # the wrapped sampler need not compute its own
        sampler.forward = forward
        setattr(sampler, PATCHED, True)

    def dapo_begin_update(self) -> None:
        """Start a layer-wise reload: each layer is re-processed once all its weights came."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def dapo_load_bucket(self, bucket: list[tuple[str, str, list[int], bytes]]) -> None:
        """Load one bucket of checkpoint-named weights (`encode_bucket`) into the model."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(decode_bucket(bucket))

    def dapo_finish_update(self) -> None:
        """Re-process the layers left, rebuild the tied head; the update is then live."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
        _reprocess_tied_head(model)


def _reprocess_tied_head(model: torch.nn.Module) -> None:
    """Rebuild a tied LM head's kernel state from the reloaded embedding.

    vLLM's layer-wise reload skips a tied head ("no weights loaded") and keeps its old
    kernel state; on CPU that is a pre-packed copy of the old embedding, so the logits
    would come from the old weights.
    """
    head = getattr(model, "lm_head", None)  # probe-ok: vLLM's model (third party)
    inner = getattr(model, "model", None)  # probe-ok: vLLM's model (third party)
    embed = getattr(inner, "embed_tokens", None)  # probe-ok: vLLM's model (third party)
    weight = getattr(head, "weight", None)  # probe-ok: vLLM's head (third party)
    if head is None or embed is None or weight is None:
        return
    if head.weight.data_ptr() == embed.weight.data_ptr():
        head.quant_method.process_weights_after_loading(head)
