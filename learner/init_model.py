"""Build a small model from nothing: a locally trained tokenizer plus a random-weight Qwen2.

Nothing is downloaded (the machines this project runs on reach no model hub), and RL from
scratch on a CPU needs a model small enough to learn in minutes. `PRESETS` names the
tokenizer + model setups (`tiny`, `tiny_long`, `tiny_vllm`, `small`) and is readable
without importing torch. What each preset is and why its tokenizer is saved as
`Qwen2Tokenizer`: docs/tasks.md, "The models".
"""

from __future__ import annotations

import hashlib
import json
import operator
import random
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.data import iter_synthetic_corpus
from services.common.reasoning import ANSWER_PREFIX

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

PROVENANCE_FILE = "dapo_model.json"

TINY_EOS = "<eos>"
TINY_EXTRA_CHARS = "+"  # not in any synthetic prompt yet, but addition tasks need it
# Only contents: the tiny model sees `3,7,1=` and answers right after it.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endif %}{% endfor %}"
)

SMALL_EOS, SMALL_PAD, SMALL_START = "<|im_end|>", "<|endoftext|>", "<|im_start|>"
SMALL_VOCAB_SIZE = 1024
SMALL_CORPUS_LINES = 4000
SMALL_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelShape:
    """Qwen2 dimensions of a preset."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool


@dataclass(frozen=True)
class Preset:
    """A model shape plus the function that builds its tokenizer."""

    shape: ModelShape
    build_tokenizer: Callable[[], PreTrainedTokenizerFast]
    stops: bool = True  # False: the generation config names no EOS
    # The vocabulary build_tokenizer makes, computed without building it (None: only by
    # building): what `model_is_current` compares with the recorded fingerprint.
    vocab: Callable[[], dict[str, int]] | None = None


# --------------------------------------------------------------------------- tokenizers


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer: `<eos>`, the synthetic alphabet (sorted), `Answer: `.

    The paper's answer prefix is one token, as in real BPE vocabularies: spelt out in
    eight characters a randomly initialised model would never write it.
    """
    from tokenizers import AddedToken

    # unk is only a label here: the BPE model has none, and one more token would be dead weight.
    special = {"eos_token": TINY_EOS, "pad_token": TINY_EOS, "unk_token": TINY_EOS}
    tokenizer = _qwen2_tokenizer(tiny_base_vocab(), [], TINY_CHAT_TEMPLATE, special)
    tokenizer.add_tokens([AddedToken(ANSWER_PREFIX, normalized=False, special=False)])
    return tokenizer


def tiny_base_vocab() -> dict[str, int]:
    """The tiny BPE model's vocabulary: `<eos>`, then the synthetic alphabet (sorted)."""
    text = "".join(iter_synthetic_corpus()).replace(ANSWER_PREFIX, "")
    alphabet = sorted(set(text) | set(TINY_EXTRA_CHARS))
    byte_chars = bytes_to_unicode()  # the byte-level pre-tokenizer's view of each character
    return {TINY_EOS: 0, **{byte_chars[ord(ch)]: i + 1 for i, ch in enumerate(alphabet)}}


def tiny_vocab() -> dict[str, int]:
    """The tiny tokenizer's whole vocabulary (its `get_vocab()`), without building it."""
    base = tiny_base_vocab()
    return {**base, ANSWER_PREFIX: len(base)}


def vocab_fingerprint(vocab: dict[str, int]) -> str:
    """A vocabulary's SHA-256, recorded at build time: a later check compares hashes
    instead of loading the saved tokenizer and building a new one (a second of start-up)."""
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (what ByteLevel maps each byte to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = (b for b in range(256) if b not in table)
    table.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return table


def build_small_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained with `tokenizers` on synthetic math text; ChatML specials."""
    from tokenizers import AddedToken, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    tok = _qwen2_pipeline({}, [])
    trainer = trainers.BpeTrainer(
        vocab_size=SMALL_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[SMALL_PAD, SMALL_START, SMALL_EOS],
        initial_alphabet=ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(math_corpus(SMALL_CORPUS_LINES), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [merge_pair(m) for m in model["merges"]]
    special = {"eos_token": SMALL_EOS, "pad_token": SMALL_PAD, "unk_token": SMALL_PAD}
    wrapped = _qwen2_tokenizer(model["vocab"], merges, SMALL_CHAT_TEMPLATE, special)
    # Only eos/pad/unk are special by default; the template's start marker must be one token.
    wrapped.add_tokens([AddedToken(SMALL_START, special=True)], special_tokens=True)
    return wrapped


def _qwen2_pipeline(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Any:
    """A `tokenizers` BPE with exactly the normalizer/pre-tokenizer Qwen2Tokenizer builds.

    transformers 5 always rebuilds a qwen2 checkpoint's tokenizer as `Qwen2Tokenizer` from
    the saved vocab and merges, so training with any other pipeline would tokenize
    differently after `AutoTokenizer.from_pretrained`.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges) if vocab else models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def merge_pair(merge: str | list[str]) -> tuple[str, str]:
    """A BPE merge as a pair, from tokenizers' JSON ("a b" or ["a", "b"])."""
    left, right = merge.split(" ") if isinstance(merge, str) else merge
    return left, right


def _qwen2_tokenizer(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    chat_template: str,
    special: dict[str, str],
) -> PreTrainedTokenizerFast:
    """Wrap vocab and merges in the class `AutoTokenizer` will load them as."""
    from transformers import Qwen2Tokenizer

    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,  # type: ignore[arg-type]  # tokenizers' BPE takes pairs; the hint says str
        bos_token=None,
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        **special,
    )


_WORDS = (
    "Find the number of positive integers such that Let be a real number complex triangle "
    "with sides area probability of choosing sum product remainder when divided by Compute "
    "the value the largest possible smallest integer polynomial roots circle radius points "
    "on a line equation solutions Suppose that and are relatively prime Determine how many "
    "ways there are to arrange digits in base square rectangle the greatest common divisor"
).split()
_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should "
    "be of the form Answer: $Answer (without quotes) where $Answer is the answer to the "
    'problem.\n\n{}\n\nRemember to put your answer on its own line after "Answer:".'
)


def math_corpus(n_lines: int, seed: int = 0) -> Iterator[str]:
    """Synthetic math text in the style of DAPO prompts and answers (fixed seed)."""
    rng = random.Random(seed)
    makers = (_arith_line, _latex_line, _word_line, _answer_line)
    for i in range(n_lines):
        line = makers[i % len(makers)](rng)
        yield _INSTRUCTION.format(line) if i % 50 == 0 else line


_OPS = (("+", operator.add), ("-", operator.sub), ("*", operator.mul))


def _arith_line(rng: random.Random) -> str:
    a, b = rng.randint(0, 999), rng.randint(1, 999)
    op, fn = rng.choice(_OPS)
    return f"{a} {op} {b} = {fn(a, b)}"


def _latex_line(rng: random.Random) -> str:
    a, b, c = (rng.randint(1, 20) for _ in range(3))
    forms = (
        f"$\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{b}}} = \\frac{{{a + c}}}{{{b}}}$",
        f"$x^{a} + {b}x - {c} = 0$ where $|z|={a}$",
        f"\\[\\sqrt{{{a * a}}} = {a}\\quad (a_{{{b}}}, b_{{{c}}})\\]",
        f"The answer is $\\boxed{{{a * b}}}$, since $\\binom{{{a}}}{{2}} \\cdot {c}$.",
    )
    return rng.choice(forms)


def _word_line(rng: random.Random) -> str:
    words = rng.choices(_WORDS, k=rng.randint(6, 16))
    return " ".join(words).capitalize() + rng.choice([".", "?", ", and $n$ is odd."])


def _answer_line(rng: random.Random) -> str:
    return f"Answer: {rng.randint(0, 999)}"


PRESETS: dict[str, Preset] = {
    "tiny": Preset(ModelShape(64, 256, 2, 4, 2, 256, True), build_tiny_tokenizer, vocab=tiny_vocab),
    "tiny_long": Preset(
        ModelShape(64, 256, 2, 4, 2, 4096, True), build_tiny_tokenizer, False, tiny_vocab
    ),
    "small": Preset(ModelShape(128, 512, 2, 2, 2, 4096, True), build_small_tokenizer),
    "tiny_vllm": Preset(
        ModelShape(64, 256, 2, 2, 2, 256, True), build_tiny_tokenizer, vocab=tiny_vocab
    ),
}


# --------------------------------------------------------------------------- model


def build_model(
    shape: ModelShape, tokenizer: PreTrainedTokenizerFast, seed: int, stops: bool = True
) -> Any:
    """Random-weight Qwen2 sized for `tokenizer`, seeded without touching global RNG state."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    eos_ids = list(dict.fromkeys([tokenizer.eos_token_id, tokenizer.pad_token_id]))
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **asdict(shape),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=(eos_ids[0] if len(eos_ids) == 1 else eos_ids) if stops else [],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def init_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write tokenizer, random model and `dapo_model.json` for `preset` into `out_dir`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    spec = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = spec.build_tokenizer()
    model: PreTrainedModel = build_model(spec.shape, tokenizer, seed, spec.stops)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    provenance = {
        "preset": preset,
        "seed": seed,
        "num_parameters": model.num_parameters(),
        "vocab_size": len(tokenizer),
        "vocab_sha256": vocab_fingerprint(tokenizer.get_vocab()),
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    return out


def model_is_current(out_dir: str | Path, preset: str) -> bool:
    """False when `out_dir` holds a random `preset` model whose tokenizer the builder no
    longer makes (the tiny alphabet grows with the synthetic tasks). A directory without
    our provenance file, or of another preset, is someone's own model: always current.
    A directory built before fingerprints were recorded is checked the slow way once
    (load and build both tokenizers) and gets its fingerprint recorded."""
    path = Path(out_dir) / PROVENANCE_FILE
    if preset not in PRESETS or not path.is_file():
        return True
    provenance = json.loads(path.read_text())
    if provenance.get("preset") != preset:
        return True
    spec = PRESETS[preset]
    if "vocab_sha256" in provenance and spec.vocab is not None:
        return bool(provenance["vocab_sha256"] == vocab_fingerprint(spec.vocab()))
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(out_dir).get_vocab()
    if saved != spec.build_tokenizer().get_vocab():
        return False
    provenance["vocab_sha256"] = vocab_fingerprint(saved)
    path.write_text(json.dumps(provenance, indent=2) + "\n")
    return True
