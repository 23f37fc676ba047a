"""Request limits of a rollout server; each violation names the config field it breaks.

The service turns `GenerateLimitExceeded` into gRPC INVALID_ARGUMENT. Size, n and
max_tokens are checked before the prompt's ids are read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from dapo.v1 import rollout_pb2
from rollout.config import RolloutSettings
from rollout.engine import out_of_vocab


class GenerateLimitExceeded(ValueError):
    """A GenerateGroup request breaks a limit; `limit` is the config field it names,
    e.g. 'shared.max_prompt_length' (sent under REFUSAL_KEY)."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class Limits:
    """The bounds a GenerateGroup request must respect."""

    max_request_bytes: int
    max_n: int
    max_prompt_length: int
    max_response_length: int

    @classmethod
    def from_config(cls, config: RolloutSettings) -> Limits:
        return cls(
            max_request_bytes=config.rollout.max_request_bytes,
            max_n=config.rollout.max_n,
            max_prompt_length=config.shared.max_prompt_length,
            max_response_length=config.shared.max_response_length,
        )

    def check_request(self, request: rollout_pb2.GenerateRequest) -> None:
        """Size, n and max_tokens; raise GenerateLimitExceeded for the first broken one."""
        size = request.ByteSize()
        if size > self.max_request_bytes:
            _fail("rollout.max_request_bytes", f"request of {size} bytes", self.max_request_bytes)
        if not 1 <= request.n <= self.max_n:
            raise GenerateLimitExceeded(
                "rollout.max_n", f"n={request.n} is outside [1, rollout.max_n={self.max_n}]"
            )
        max_tokens = request.sampling.max_tokens
        if max_tokens > self.max_response_length:
            _fail(
                "shared.max_response_length", f"max_tokens={max_tokens}", self.max_response_length
            )

    def check_prompt(self, prompt: Sequence[int], vocab_size: int) -> None:
        """Length and token ids of the prompt (prompt_token_ids, as the controller sent them)."""
        if not prompt:
            raise GenerateLimitExceeded("prompt", "the prompt is empty (no prompt_token_ids)")
        if len(prompt) > self.max_prompt_length:
            _fail(
                "shared.max_prompt_length",
                f"prompt of {len(prompt)} tokens",
                self.max_prompt_length,
            )
        bad = out_of_vocab(prompt, vocab_size)
        if bad is not None:
            raise GenerateLimitExceeded(
                "vocab_size", f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})"
            )


def _fail(limit: str, what: str, bound: int) -> NoReturn:
    raise GenerateLimitExceeded(limit, f"{what} exceeds {limit}={bound}")
