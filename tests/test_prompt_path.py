"""A dataset row's conversation is what the policy sees, byte for byte: rendered once at load
by the model's own tokenizer, carried as token ids through the controller's request, and
handed to the engine unchanged by the rollout server, system turn included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from messy_data import SYSTEM, system_model, system_rows, write_jsonl
from rollout_fixtures import make_config, serve
from transformers import AutoTokenizer

from services.common.settings import SamplingConfig
from services.common.tokenizer import load_tokenizer
from services.controller import adapter
from services.controller.config import DatasetConfig
from services.controller.dataset import load_training_data


def test_a_system_message_reaches_the_engine_byte_for_byte(
    tmp_path: Path, tiny_model: Path
) -> None:
    model = system_model(tiny_model, tmp_path / "model")
    data = write_jsonl(tmp_path / "system.jsonl", system_rows(3))
    tokenizer = load_tokenizer(model, chat=True)
    cfg = DatasetConfig(kind="jsonl", path=str(data))
    records = load_training_data(cfg, 0, tokenizer, 12).records
    seen: list[list[int]] = []

    def recording(engine: Any) -> Any:
        stream = engine.stream

        def recorded(prompts: list[list[int]], params: Any) -> Any:
            seen.extend(list(p) for p in prompts)
            return stream(prompts, params)

        engine.stream = recorded
        return engine

    theirs = AutoTokenizer.from_pretrained(model)
    with serve(model, make_config(), wrap=recording) as s:
        for record in records:
            seen.clear()
            request = adapter.generate_request(
                record.prompt_id, record, 2, SamplingConfig(), 2, tokenizer.fingerprint
            )
            group = s.stub.GenerateGroup(request, timeout=60)
            text = theirs.apply_chat_template(
                record.messages, add_generation_prompt=True, tokenize=False
            )
            assert text == SYSTEM + record.prompt  # the system turn, then the user's
            assert seen and all(theirs.decode(p) == text for p in seen)
            assert list(group.prompt_token_ids) == seen[0] == record.prompt_token_ids
