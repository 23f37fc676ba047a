"""The one translation between the reward protobufs and the service's dataclasses."""

from __future__ import annotations

from dapo.v1 import reward_pb2
from reward.scoring import RequestError, ScoreInput, ScoreOutput

VERIFIER_NAMES: dict[int, str | None] = {
    reward_pb2.VERIFIER_UNSPECIFIED: None,
    reward_pb2.VERIFIER_DAPO: "dapo",
    reward_pb2.VERIFIER_MATH_VERIFY: "math_verify",
    reward_pb2.VERIFIER_CASCADE: "cascade",
    reward_pb2.VERIFIER_FIRST_INTEGER: "first_integer",
}
VERIFIER_ENUMS: dict[str, int] = {
    name: value for value, name in VERIFIER_NAMES.items() if name is not None
}


def parse_request(data: bytes) -> reward_pb2.ScoreRequest:
    """Decode a ScoreRequest; undecodable bytes (e.g. invalid UTF-8) are a RequestError."""
    request = reward_pb2.ScoreRequest()
    try:
        request.ParseFromString(data)
    except Exception as exc:  # protobuf raises DecodeError or a runtime-specific error
        raise RequestError(f"cannot decode ScoreRequest: {exc}") from None
    return request


def verifier_name(value: int, index: int) -> str | None:
    """Enum → verifier name; an unknown number is a RequestError naming the item."""
    if value not in VERIFIER_NAMES:
        raise RequestError(f"item {index}: unknown verifier enum value {value}")
    return VERIFIER_NAMES[value]


def inputs_from_proto(request: reward_pb2.ScoreRequest) -> list[ScoreInput]:
    """ScoreRequest → ScoreInputs, in order."""
    return [
        ScoreInput(
            response=item.response,
            ground_truth=item.ground_truth,
            id=item.id,
            verifier=verifier_name(item.verifier, index),
            response_length=item.response_length,
            truncated=item.truncated,
        )
        for index, item in enumerate(request.items)
    ]


def outputs_to_proto(outputs: list[ScoreOutput]) -> reward_pb2.ScoreResponse:
    """ScoreOutputs → ScoreResponse, in order."""
    return reward_pb2.ScoreResponse(
        results=[
            reward_pb2.ScoreResult(
                id=o.id,
                reward=o.reward,
                correct=o.correct,
                pred=o.pred,
                verifier=VERIFIER_ENUMS.get(o.verifier, reward_pb2.VERIFIER_UNSPECIFIED),
                error=o.error,
                overlong_penalty=o.overlong_penalty,
                truncated=o.truncated,
            )
            for o in outputs
        ]
    )


def proto_from_inputs(items: list[ScoreInput]) -> reward_pb2.ScoreRequest:
    """ScoreInputs → ScoreRequest (for clients and the benchmark)."""
    return reward_pb2.ScoreRequest(
        items=[
            reward_pb2.ScoreItem(
                id=i.id,
                response=i.response,
                ground_truth=i.ground_truth,
                verifier=VERIFIER_ENUMS.get(i.verifier or "", reward_pb2.VERIFIER_UNSPECIFIED),
                response_length=i.response_length,
                truncated=i.truncated,
            )
            for i in items
        ]
    )
