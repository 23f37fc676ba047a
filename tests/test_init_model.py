"""Offline model init: tokenizer + random Qwen2 saved so the Auto classes load them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from learner.init_model import (  # noqa: E402
    PRESETS,
    PROVENANCE_FILE,
    build_small_tokenizer,
    init_model,
    model_is_current,
    tiny_vocab,
    vocab_fingerprint,
)
from services.common.data import SYNTHETIC_TASKS, aime_path, load_records, synthetic_records  # noqa: E402
from services.common.reasoning import (  # noqa: E402
    ANSWER_PREFIX,
    REASONING_TASKS,
    gold_response,
    parse_prompt,
)

AIME = aime_path()
TINY_PARAMS = 124_480  # see test_tiny_parameter_count for the arithmetic


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("small") / "model", "small", seed=0)


def _synthetic_texts() -> list[str]:
    texts = []
    for task in SYNTHETIC_TASKS:
        for split in ("train", "test"):
            texts += [
                t for r in synthetic_records(task, split=split) for t in (r.prompt, r.ground_truth)
            ]
    return texts


# --------------------------------------------------------------------------- tiny


def test_tiny_loads_with_auto_classes(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert len(tok) == 16 and model.config.vocab_size == 16
    assert tok.eos_token == tok.pad_token == "<eos>"
    assert tok.eos_token_id == tok.pad_token_id == 0 and tok.bos_token is None
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (64, 2, 256)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id) == (0, 0)


def test_tiny_vocabulary_is_the_synthetic_alphabet(tiny_dir: Path) -> None:
    vocab = AutoTokenizer.from_pretrained(tiny_dir).get_vocab()
    # "Ċ" is the byte-level form of "\n"; the paper's answer prefix is one token.
    assert set(vocab) == {"<eos>", "+", ",", "=", "Ċ", "Answer: ", *"0123456789"}
    assert vocab["<eos>"] == 0


def test_tiny_parameter_count(tiny_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    h, ffn, kv, vocab = 64, 256, 32, 16  # kv = 2 KV heads x head_dim 16
    attention = (h * h + h) + 2 * (h * kv + kv) + h * h  # q, k, v carry biases; o does not
    layer = attention + 3 * h * ffn + 2 * h  # gate/up/down + two RMSNorms
    expected = vocab * h + 2 * layer + h  # tied embeddings counted once, final norm
    assert expected == TINY_PARAMS
    assert model.num_parameters() == TINY_PARAMS
    assert json.loads((tiny_dir / PROVENANCE_FILE).read_text()) == {
        "preset": "tiny",
        "seed": 0,
        "num_parameters": TINY_PARAMS,
        "vocab_size": 16,
        "vocab_sha256": vocab_fingerprint(tiny_vocab()),
    }


def test_tiny_tokenizer_round_trips_synthetic_text(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    for text in _synthetic_texts() + ["12+34=46"]:
        ids = tok(text).input_ids
        assert len(ids) == len(text), text  # one token per character
        assert tok.decode(ids) == text
    assert tok.decode(tok("3,7,1=").input_ids + [tok.eos_token_id]) == "3,7,1=<eos>"


def test_tiny_tokenizer_covers_the_reasoning_tasks(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    answer_id = tok.convert_tokens_to_ids(ANSWER_PREFIX)
    for task in REASONING_TASKS:
        for record in synthetic_records(task, split="test"):
            text = gold_response(task, parse_prompt(record.prompt))
            ids = tok(text).input_ids
            # one token per character, except the answer prefix: one token
            assert len(ids) == len(text) - len(ANSWER_PREFIX) + 1, text
            assert ids.count(answer_id) == 1
            assert tok.decode(ids) == text


def test_tiny_chat_template_is_the_bare_prompt(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    chat = [{"role": "user", "content": "3,7,1="}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == "3,7,1="
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert list(ids) == tok("3,7,1=").input_ids
    full = chat + [{"role": "assistant", "content": "7"}]
    assert tok.apply_chat_template(full, tokenize=False) == "3,7,1=7<eos>"


def test_tiny_model_generates_in_a_batch(tiny_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    batch = tok(["3,7,1=", "4,2="], return_tensors="pt", padding=True)
    out = model.generate(**batch, min_new_tokens=4, max_new_tokens=4, do_sample=False)
    width = batch.input_ids.shape[1]
    assert out.shape == (2, width + 4)
    assert torch.equal(out[:, :width], batch.input_ids)
    assert int(out.max()) < 16


# --------------------------------------------------------------------------- seeds


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def test_same_seed_same_weights_other_seed_differs(tiny_dir: Path, tmp_path: Path) -> None:
    again = _weights(init_model(tmp_path / "a", "tiny", seed=0))
    other = _weights(init_model(tmp_path / "b", "tiny", seed=1))
    first = _weights(tiny_dir)
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    # The tokenizer depends on the preset only, so seeds share token ids.
    assert (tmp_path / "b" / "tokenizer.json").read_text() == (
        tiny_dir / "tokenizer.json"
    ).read_text()


def test_init_leaves_global_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    init_model(tmp_path, "tiny", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_preset_fails_clearly(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown model preset 'huge'; valid presets: tiny, tiny_long, small, tiny_vllm",
    ):
        init_model(tmp_path / "out", "huge")
    assert not (tmp_path / "out").exists()
    assert set(PRESETS) == {"tiny", "tiny_long", "tiny_vllm", "small"}


def test_tiny_long_names_no_eos(tmp_path: Path) -> None:
    """The `long` run preset's model: same tokenizer as tiny, generation never stops."""
    from transformers import GenerationConfig

    init_model(tmp_path, "tiny_long", seed=0)
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == []
    assert AutoTokenizer.from_pretrained(tmp_path).eos_token == "<eos>"


# --------------------------------------------------------------------------- small


def test_small_loads_with_auto_classes(small_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(small_dir)
    model = AutoModelForCausalLM.from_pretrained(small_dir)
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert (cfg.hidden_size, cfg.num_hidden_layers) == (128, 2)
    assert cfg.vocab_size == len(tok) > 300
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    gen = model.generation_config
    assert set(gen.eos_token_id) == {tok.eos_token_id, tok.pad_token_id}
    assert gen.pad_token_id == tok.pad_token_id
    assert json.loads((small_dir / PROVENANCE_FILE).read_text())["preset"] == "small"


def test_small_chat_template(small_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(small_dir)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok(text).input_ids) == text
    assert tok.convert_tokens_to_ids("<|im_start|>") in tok(text).input_ids


def test_small_tokenizer_is_deterministic() -> None:
    first, second = build_small_tokenizer(), build_small_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()


@pytest.mark.skipif(
    not AIME.is_file(), reason=f"AIME parquet not found at {AIME} (set DAPO_AIME_PARQUET)"
)
def test_small_tokenizer_round_trips_aime(small_dir: Path) -> None:
    loaded = AutoTokenizer.from_pretrained(small_dir)
    fresh = build_small_tokenizer()
    for record in load_records(AIME, unique=True):
        ids = loaded(record.prompt).input_ids
        assert loaded.decode(ids) == record.prompt
        # What was trained is what AutoTokenizer rebuilds: identical ids.
        assert fresh(record.prompt).input_ids == ids
        assert len(ids) < 2 * len(record.prompt) // 3  # merges were learned


def test_a_model_built_with_an_older_tiny_alphabet_is_rebuilt(
    tiny_dir: Path, tmp_path: Path
) -> None:
    from learner.init_model import TINY_CHAT_TEMPLATE, TINY_EOS, _qwen2_tokenizer
    from services.tools.config import load_config
    from services.tools.launcher import ensure_model

    assert model_is_current(tiny_dir, "tiny")
    old = tmp_path / "old"
    init_model(old, "tiny", seed=0)
    vocab = {TINY_EOS: 0, **{ch: i + 1 for i, ch in enumerate("+,0123456789=")}}  # 14 tokens
    special = {"eos_token": TINY_EOS, "pad_token": TINY_EOS, "unk_token": TINY_EOS}
    older = _qwen2_tokenizer(vocab, [], TINY_CHAT_TEMPLATE, special)
    older.save_pretrained(old)
    provenance = json.loads((old / PROVENANCE_FILE).read_text())
    # Built before fingerprints were recorded: found by loading and building both.
    del provenance["vocab_sha256"]
    (old / PROVENANCE_FILE).write_text(json.dumps(provenance))
    assert not model_is_current(old, "tiny")
    # Built by an older builder that recorded its fingerprint: found by the hashes alone.
    provenance["vocab_sha256"] = vocab_fingerprint(older.get_vocab())
    (old / PROVENANCE_FILE).write_text(json.dumps(provenance))
    assert not model_is_current(old, "tiny")
    assert model_is_current(old, "small")  # built as tiny: not this preset's to judge
    (old / PROVENANCE_FILE).unlink()
    assert model_is_current(old, "tiny")  # no provenance: someone's own model, kept
    init_model(old, "tiny", seed=0)
    older.save_pretrained(old)
    (old / PROVENANCE_FILE).write_text(json.dumps(provenance))  # the older builder's record
    config = load_config(preset="tiny", env={}, overrides=[f"shared.model_path={old}"])
    ensure_model(config)
    assert len(AutoTokenizer.from_pretrained(old)) == 16


def test_the_recorded_fingerprint_is_the_builders_vocabulary(tiny_dir: Path) -> None:
    """A preset's cheap `vocab` is exactly what its builder makes, so comparing hashes
    decides what loading and building both tokenizers would; a directory without a
    fingerprint is checked the slow way once and gets it recorded."""
    for name, preset in PRESETS.items():
        if preset.vocab is not None:
            assert preset.vocab() == preset.build_tokenizer().get_vocab(), name
    provenance = json.loads((tiny_dir / PROVENANCE_FILE).read_text())
    recorded = provenance.pop("vocab_sha256")
    assert recorded == vocab_fingerprint(AutoTokenizer.from_pretrained(tiny_dir).get_vocab())
    (tiny_dir / PROVENANCE_FILE).write_text(json.dumps(provenance))
    assert model_is_current(tiny_dir, "tiny")
    assert json.loads((tiny_dir / PROVENANCE_FILE).read_text())["vocab_sha256"] == recorded
