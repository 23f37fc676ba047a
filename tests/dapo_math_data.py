"""A small parquet file in the DAPO-Math-17k release's schema, generated (no real data).

The release (BytedTsinghua-SIA/DAPO-Math-17k, `dapo-math-17k.parquet`) has the AIME
file's columns: `data_source` "math_dapo", `prompt` a list of {content, role} structs,
`ability` "MATH", `reward_model` {ground_truth, style "rule-lighteval/MATH_v2"}, and
`extra_info` with only `index` (a UUID string; AIME's has an integer index, raw_problem
and split). It holds each of its ~17k problems about 100 times. The problems here are
max3 prompts that the tiny test models can answer, in that layout.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from services.common.data import synthetic_records

SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        ("extra_info", pa.struct([("index", pa.string())])),
    ]
)


def write_dapo_math(path: Path, problems: int, copies: int, same_index: bool = True) -> Path:
    """`problems` max3 problems, each repeated `copies` times (row order: all problems,
    then again); copies share their UUID index when `same_index`, else each row has its own."""
    records = synthetic_records("max3", split="test")[:problems]
    ids = [str(uuid.UUID(int=i + 1)) for i in range(problems * copies)]
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": r.prompt, "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": r.ground_truth, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": ids[i] if same_index else ids[c * problems + i]},
        }
        for c in range(copies)
        for i, r in enumerate(records)
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), path)
    return path
