"""`POST /v1/score`: the JSON face of the reward service, for callers outside the system.

The body is read with a size cap (413 past `reward.max_request_bytes`) and parsed with
Python's json module after decoding with replacement, so stray invalid UTF-8 or lone
surrogate escapes from byte-level tokenizers become U+FFFD / "?" instead of failing the
whole batch. Schema errors and broken limits are 422 with a message naming the field or
the limit, and so is JSON that Python cannot parse for its structure (nested past the
recursion limit, integers of thousands of digits). See docs/reward.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.concurrency import run_in_threadpool

from reward.config import VerifierName
from reward.scoring import RequestError, ScoreInput, ScoreLimitExceeded, Scorer
from services.common.errors import describe_validation, one_line


def clean_text(text: str) -> str:
    """The text with lone surrogates replaced by "?" (they cannot be encoded as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


class JsonItem(BaseModel):
    """One item of a /v1/score request."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field("", description="Echoed in the result.")
    response: str = Field(description="The model's response text.")
    ground_truth: str = Field(
        description="The gold answer; an integer is taken as its decimal string."
    )
    verifier: VerifierName | None = Field(None, description="None = the server's default.")
    response_length: int | None = Field(
        None, ge=0, description="Response length in tokens for the overlong penalty."
    )
    truncated: bool = Field(False, description="The response hit the length limit.")

    @field_validator("ground_truth", mode="before")
    @classmethod
    def _integer_as_text(cls, value: Any) -> Any:
        """AIME-style answers are integers; JSON writers send them as numbers (`"7"` is
        what every verifier compares). Booleans and floats stay refused: their text is
        ambiguous (`True`, `1e+20`)."""
        if isinstance(value, int) and not isinstance(value, bool):
            return str(value)
        return value

    @field_validator("id", "response", "ground_truth")
    @classmethod
    def _encodable(cls, value: str) -> str:
        return clean_text(value)

    def to_input(self) -> ScoreInput:
        return ScoreInput(
            response=self.response,
            ground_truth=self.ground_truth,
            id=self.id,
            verifier=self.verifier,
            response_length=self.response_length or 0,
            truncated=self.truncated,
        )


class JsonRequest(BaseModel):
    """The /v1/score request body."""

    model_config = ConfigDict(extra="forbid")

    items: list[JsonItem]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything past `limit` bytes without buffering it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> ScoreLimitExceeded:
    message = f"request body of {size}+ bytes > reward.max_request_bytes={limit}"
    return ScoreLimitExceeded("max_request_bytes", message, http_status=413)


def parse_items(body: bytes) -> list[ScoreInput]:
    """JSON body → ScoreInputs, or a RequestError (422) naming what is wrong."""
    data = parse_json(body)
    try:
        request = JsonRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestError(_describe(exc)) from None
    return [item.to_input() for item in request.items]


def parse_json(body: bytes) -> Any:
    """The body as JSON, or a RequestError for anything json.loads refuses: besides syntax,
    nesting deeper than Python's recursion limit (RecursionError) and integers of more
    digits than `sys.get_int_max_str_digits()` (ValueError), which would otherwise be 500s."""
    try:
        return json.loads(body.decode("utf-8", "replace"))
    except json.JSONDecodeError as exc:
        raise RequestError(f"body is not JSON: {exc}") from None
    except RecursionError:
        raise RequestError("body is not usable JSON: nested too deeply") from None
    except ValueError as exc:  # an integer literal past the int conversion limit
        raise RequestError(f"body is not usable JSON: {one_line(str(exc))}") from None


def _describe(exc: ValidationError) -> str:
    """One line naming each problem's field path (control characters escaped)."""
    return "invalid request: " + describe_validation(exc.errors(), "body")


def error_response(exc: RequestError) -> JSONResponse:
    """The JSON body of a refused request."""
    content: dict[str, Any] = {"detail": str(exc)}
    if isinstance(exc, ScoreLimitExceeded):
        content["limit"] = exc.limit
    return JSONResponse(content, status_code=exc.http_status)


def add_score_route(
    app: FastAPI, scorer: Scorer, max_request_bytes: int, dependencies: Sequence[Any] = ()
) -> None:
    """Mount POST /v1/score on `app` (`dependencies`: e.g. the bearer-token guard)."""

    @app.post(
        "/v1/score",
        summary="Score responses against ground truths (docs/reward.md)",
        dependencies=list(dependencies),
    )
    async def score(request: Request) -> JSONResponse:
        try:
            body = await read_body(request, max_request_bytes)
            items = parse_items(body)
            outputs = await run_in_threadpool(scorer.score, items, "http")
        except RequestError as exc:
            return error_response(exc)
        return JSONResponse({"results": [asdict(o) for o in outputs]})
